"""Artifacts: files and hashes, the local and S3 stores behind one `Store` protocol, the model registry, DVC."""
