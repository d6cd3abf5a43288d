"""Private Rehearsal at test time (METHOD.md §4): the agent, the verifier filter and `envace rehearse`'s view."""
