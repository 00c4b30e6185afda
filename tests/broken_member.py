"""A member that cannot start (controller tests): it dies at import, as with a broken environment."""

raise ImportError("No module named 'transformers' (broken_member: a test of start-up failures)")
