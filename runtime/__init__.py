"""Runtime: the actor runtime that schedules a job's work.

Actors (a stage's forward or backward for one micro-batch, a send or receive,
a data reader, a gradient reduction, an optimizer update) fire when their
inputs are ready and they have a free out register; registers, req/ack
messages, one thread per hardware queue, plans and Chrome-trace timelines live
here. Pipelining follows from register quotas, not a hand-written schedule.
May import ``sbp_core``; nothing else of ours.
"""
