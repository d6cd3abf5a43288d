"""World Rehearsal training (METHOD.md §2-3): rollouts, rewards, the row contract, role-wise GRPO, the trainer and the loop."""
