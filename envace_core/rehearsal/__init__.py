"""rehearsal."""
