"""Tool learning (METHOD.md §5): new tools' inputs, rehearsal tasks for them, adaptation and measurement."""
