"""tool_learning."""
