"""InsightFace: face recognition with a data-parallel backbone and a class-split margin-softmax FC (Partial FC)."""
