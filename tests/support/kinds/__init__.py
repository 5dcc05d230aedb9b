"""A kind of the tests' own, registered the way an operator registers theirs (README, "A kind
of your own"): `echo` (echo.py registers it, echo_handler.py runs it), touching no production
file."""
