"""The policy's roles (METHOD.md §1): prompt rendering and strict output parsing for ACT, REHEARSE, USER and SELF-EVAL."""
