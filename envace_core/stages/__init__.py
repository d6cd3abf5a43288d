"""The pipeline's stages as plain functions, one module per Flyte task in `tasks/` (DESIGN.md, "How data flows")."""
