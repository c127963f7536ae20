# The two commands of README's Quick start.  Both set up first (scripts/setup.sh
# is idempotent), so they work on a fresh machine from a clean clone.
.PHONY: demo test setup

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/python -m vramd.demo

test: setup
	.venv/bin/python -m pytest -q --durations=25
