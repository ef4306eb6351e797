"""InsightFace's data: MXNet RecordIO face records, image folders, synthetic identities, verification pairs."""
