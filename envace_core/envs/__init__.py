"""Environment adapters: one per source of tool environments, all behind `ToolEnvironment`."""
