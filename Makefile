# The two set-up-and-go commands: `make run` (the main job) and `make test` (every test).
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup lock run test lint protos wheel images

# Installs exactly the committed locks (requirements/dev.lock, package-lock.json).
setup:
	@scripts/setup.sh

# Refreshes the locks on purpose (newest releases), then the generated code with the new toolchain.
lock:
	@scripts/lock.sh

protos: setup
	@PATH=$(CURDIR)/.venv/bin:$$PATH scripts/gen_protos.sh

# Proto lint, no breaking change against main (scripts/buf_breaking.sh says which commit), the
# "generated code is current" check, then ruff (ruff.toml) over the Python code and mypy (mypy.ini: strict for
# the directory, connector, data plane and api) over src/kvpush; both report, and any finding fails. mypy keeps
# its cache in .mypy_cache (a cold run takes ~20 s on 2 cores, a warm one ~2 s): CI can keep that folder.
lint: setup
	@cd protos && ../node_modules/.bin/buf lint
	@scripts/buf_breaking.sh
	@PATH=$(CURDIR)/.venv/bin:$$PATH scripts/gen_protos.sh && git diff --exit-code -- src/kvpush/v1 \
		|| { echo "src/kvpush/v1 is stale: run 'make protos' and commit"; exit 1; }
	@status=0; .venv/bin/ruff check --no-fix src tests bench examples scripts || status=1; \
		.venv/bin/mypy || status=1; exit $$status

run: setup
	@$(PY) -m kvpush.localstack.demo

# pytest exits 5 when it collects nothing; that fails here like any other non-zero exit.
test: lint
	@$(PY) -m pytest $(PYTEST_ARGS)

# dist/kvpush-<version>-py3-none-any.whl, what users install (docs/install.md). With the build backend of .venv when
# there is one (no setup run, no download); build/ is cleared first so no removed module lingers in the wheel.
# A fixed SOURCE_DATE_EPOCH makes the same sources the same wheel, byte for byte (the images' layers stay cached).
WHEEL_PY := $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
wheel:
	@rm -rf build dist/kvpush-*.whl
	@SOURCE_DATE_EPOCH=315532800 $(WHEEL_PY) -m build --wheel --no-isolation --outdir dist . >/dev/null
	@ls dist/kvpush-*.whl

# The directory, gateway and CPU engine images from that wheel, with podman (scripts/images.sh; root).
images: wheel
	@nice -n 10 scripts/images.sh build
