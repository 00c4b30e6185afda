"""RobustRL role services (one package per role)."""
