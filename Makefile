# The two set-up-and-go commands: `make run` (the main job) and `make test` (every test).
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup lock run test lint protos

# Installs exactly the committed locks (requirements/dev.lock, package-lock.json).
setup:
	@scripts/setup.sh

# Refreshes the locks on purpose (newest releases), then the generated code with the new toolchain.
lock:
	@scripts/lock.sh

protos: setup
	@PATH=$(CURDIR)/.venv/bin:$$PATH scripts/gen_protos.sh

# Proto lint, no breaking change against main (scripts/buf_breaking.sh says which commit), and
# "generated code is current" check.
lint: setup
	@cd protos && ../node_modules/.bin/buf lint
	@scripts/buf_breaking.sh
	@PATH=$(CURDIR)/.venv/bin:$$PATH scripts/gen_protos.sh && git diff --exit-code -- kvpush/v1 \
		|| { echo "kvpush/v1 is stale: run 'make protos' and commit"; exit 1; }

run: setup
	@$(PY) -m kvpush.demo

# pytest exits 5 when it collects nothing; that fails here like any other non-zero exit.
test: lint
	@$(PY) -m pytest $(PYTEST_ARGS)
