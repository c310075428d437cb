# The two commands: `make demo` and `make test`. Both create .venv and install what is missing.
# `make check` is the edit-test loop: `make lint` (ruff + mypy) then `make unit`, the fast tier
# (no process, no compile: tests/unit/conftest.py; under a minute on the 2-core box);
# `make test` runs both tiers and lint, as CI does.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The Compose specification's JSON schema, as shipped in docker-compose 1.29.2's wheel: the
# compose test validates docker-compose.yml against it (no Docker engine runs here).
COMPOSE_SCHEMA := .cache/compose-spec.json

# Supported torch releases besides .venv's (2.13): each gets a venv of its own (.venv-2.11)
# for the tests of the code that reads torch's internals (torch_adapter/ and compiler/, of both
# tiers) and one end-to-end miss-then-hit (`make test-versions`); the rest runs on 2.13. CUDA builds
# from PyPI run torch.compile on the CPU too (5.3 GB each). Every release's pin lives in
# requirements/torch-X.Y.txt, which pip installs from: a pin that pip reads from a file on
# main is what a machine-wide cap on torch honours (a bare `pip install torch==...` is refused
# on a new machine of this project's kind).
OTHER_TORCH := 2.11 2.12 2.14 2.15
OTHER_VENVS := $(OTHER_TORCH:%=.venv-%/.installed)
VERSION_RUNS := $(OTHER_TORCH:%=test-version-%)

.PHONY: demo test check checks lint-and-unit unit integration lint deps system proto bench coverage zoo clean test-versions other-venvs $(VERSION_RUNS)

demo: deps
	$(PY) examples/demo.py

# The integration tier runs on two pytest-xdist workers, one test file at a time each (every
# farm a test starts is its own: redis-server, gateway and workers on ports picked at run
# time, in private temporary dirs), much of it waiting on farms. Beside it: lint and the unit
# tier, and the other torch releases (below).
INTEGRATION_WORKERS := 2

# The two run as two makes side by side, sharing no job slots: under `make -j2 integration
# checks` (the checks' own make resets to -j3 inside it) one fresh-clone CI started the tier
# only as the last release's tests began, 12.5 minutes late; the runs before had it at once.
test: deps $(COMPOSE_SCHEMA)
	$(MAKE) checks & checks=$$!; \
	$(MAKE) integration; status=$$?; \
	wait $$checks || status=$$?; exit $$status

# Three jobs at most: lint then unit; one release's venv installing; one release's tests.
checks:
	$(MAKE) -j3 lint-and-unit test-versions

lint-and-unit:
	$(MAKE) -j1 lint unit

check: lint-and-unit

# Two pytest-xdist workers: each imports torch, Dynamo and Inductor (~7 CPU-s) and starts its
# servers, but one waits (a server's start, a lease's TTL) while the other computes. The
# .pyc of the project's and the tests' modules are written (PYTHONDONTWRITEBYTECODE emptied,
# as these machines set it): from the second run on, each worker's collection takes ~2 CPU-s
# less. 580 tests: 41-49 s on the 2-core box at load 2-3.3 (55 CPU-s; 62-63 s and 63 CPU-s
# before the S3 server's kill, the shorter coordinator ticks and tests/unit/conftest.py's exit).
unit: deps $(COMPOSE_SCHEMA)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider -n 2 tests/unit

# Without test_versions.py: it is the other releases' end-to-end check (below), and on .venv's
# torch its two tests are the tier's own, with more asserted: a fresh process's miss and
# another's hit without a compiler (test_farm.py's, a larger model, another tenant) and a
# program through AOTInductor, miss then hit, equal to eager (test_export.py's first test);
# that the release is verified, tests/unit/torch_adapter/test_gate.py. It cost the tier an
# AOTInductor compile and an MLP's (~100 s of a worker at CI's load).
integration: deps
	$(PY) -m pytest -q -p no:cacheprovider -n $(INTEGRATION_WORKERS) --dist loadfile \
		--no-loadscope-reorder --durations=25 --ignore=tests/integration/test_versions.py \
		tests/integration

# The other releases: each one's venv (.venv-2.11/.installed), then its tests (test-version-2.11).
# Installs run one after another, and so do the releases' tests, but the next release's venv
# installs (5.3 GB unpacked from local wheels: disk, little CPU) while this one's tests run,
# instead of all four installs before the first test.
# $(call in_a_row,A B C): B waits for A and C for B (order-only: nothing is redone for it).
# Only where all of them are asked for: `make test-version-2.14` alone runs 2.14 alone.
in_a_row = $(if $(word 2,$(1)),$(eval $(word 2,$(1)): | $(word 1,$(1)))$(call in_a_row,$(wordlist 2,$(words $(1)),$(1))))
# $(call two_ahead,VENVS,RUNS): the third venv waits for the first release's tests, and so
# on, so that at most two releases' venvs are on disk at once (see KEEP_VENV_FREE_GB).
two_ahead = $(if $(word 3,$(1)),$(eval $(word 3,$(1)): | $(word 1,$(2)))$(call two_ahead,$(wordlist 2,$(words $(1)),$(1)),$(wordlist 2,$(words $(2)),$(2))))
ifneq ($(filter test checks test-versions other-venvs,$(or $(MAKECMDGOALS),demo)),)
$(call in_a_row,$(OTHER_VENVS))
$(call in_a_row,$(VERSION_RUNS))
endif
ifneq ($(filter test checks test-versions,$(or $(MAKECMDGOALS),demo)),)
$(call two_ahead,$(OTHER_VENVS),$(VERSION_RUNS))
endif

other-venvs: $(OTHER_VENVS)

# A release's extras beyond server and dev: torchvision (and timm, which imports it) only
# where its wheel matches the release's torch build (pyproject.toml's `vision` extra).
EXTRAS_2.14 := ,vision

$(OTHER_VENVS): .venv-%/.installed: requirements/torch-%.txt pyproject.toml
	python3 -m venv .venv-$*
	.venv-$*/bin/pip install -q --upgrade pip
	.venv-$*/bin/pip install -q --no-compile -r requirements/torch-$*.txt
	.venv-$*/bin/pip install -q --no-compile -c requirements/torch-$*.txt -e '.[server,dev$(EXTRAS_$*)]'
	touch $@

test-versions: $(VERSION_RUNS)

# A release's venv is kept for the next run only where the disk keeps room for the rest
# (KEEP_VENV_FREE_GB free after it): four of them take 21 GB, and a CI machine's disk may not
# hold them beside the integration tier's farms (a full disk failed a compile there).
KEEP_VENV_FREE_GB := 40

# The zoo's rows a release runs besides .venv's (tests/integration/test_zoo.py, ZOO_MODELS):
# none in `make test` (torchvision's CNN added ~200 s to 2.14's run, and CI was over its 40
# minutes); `make zoo` runs the vision models (ZOO_VISION) on 2.14, the release whose
# torchvision imports here. `make test-version-2.14 ZOO_2.14=torchvision-resnet` runs one.
ZOO_2.14 :=
ZOO_VISION := timm-convnext,torchvision-resnet

# The venvs are installed without byte-compiling (--no-compile: the install is on the way to
# the first release's tests, and byte-compiling the project's extras, transformers and mypy
# among them, cost 23 of its 47 CPU-s, for modules these runs never import), so their runs
# write the .pyc of what they import: with
# PYTHONDONTWRITEBYTECODE set (as on these machines) every process of a run (pytest, the
# farm's, each client and compile child) compiled torch's and Inductor's sources again, ~6
# CPU-s each: a 2.11 run took 206 CPU-s, and 113 writing its own .pyc (cpuacct cgroup).
$(VERSION_RUNS): test-version-%: .venv-%/.installed $(COMPOSE_SCHEMA)
	@echo "== torch $* (.venv-$*)"
	PYTHONDONTWRITEBYTECODE= ZOO_MODELS=$(ZOO_$*) .venv-$*/bin/python -m pytest -q -p no:cacheprovider \
		tests/unit/torch_adapter tests/unit/compiler tests/integration/torch_adapter \
		tests/integration/compiler tests/integration/test_versions.py \
		$(if $(ZOO_$*),tests/integration/test_zoo.py); status=$$?; \
	free_gb=$$(( $$(df --output=avail -k . | tail -1) / 1048576 )); \
	if [ $$free_gb -lt $(KEEP_VENV_FREE_GB) ]; then \
		echo "== torch $*: removing .venv-$* ($$free_gb GB free)"; rm -rf .venv-$*; fi; \
	exit $$status

lint: deps
	$(VENV)/bin/ruff check torchfarm tests bench examples
	$(VENV)/bin/ruff format --check torchfarm tests bench examples
	$(VENV)/bin/mypy

deps: system $(STAMP)

system:
	@bash scripts/install-system-deps.sh

$(STAMP): pyproject.toml requirements/torch-2.13.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first, pinned: on these machines 2.13.0 is a local CPU wheel.
	$(VENV)/bin/pip install -q -r requirements/torch-2.13.txt
	$(VENV)/bin/pip install -q -c requirements/torch-2.13.txt -e '.[server,dev]'
	touch $@

$(COMPOSE_SCHEMA): $(STAMP)
	mkdir -p .cache/wheels
	$(VENV)/bin/pip download -q --no-deps -d .cache/wheels docker-compose==1.29.2
	$(PY) -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('compose/config/compose_spec.json'))" .cache/wheels/docker_compose-1.29.2-py2.py3-none-any.whl $@

proto: deps
	PATH=$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --mypy_out=. \
		--mypy_grpc_out=. torchfarm/proto/torchfarm.proto

bench: deps
	$(PY) bench/warm_start.py

# Issue 7's suite on an embedded farm; rewrites docs/coverage.md (and this machine's results).
coverage: deps
	$(PY) bench/coverage/suite.py

# The third-party zoo (issue 49, tests/zoo) on an embedded farm: every model on .venv's torch,
# then the timm and torchvision ones on 2.14, the release whose torchvision imports here; a
# table each, and their rows in .cache/zoo/.
zoo: deps .venv-2.14/.installed
	mkdir -p .cache/zoo
	$(PY) -m tests.zoo.runner --json .cache/zoo/rows-2.13.json
	.venv-2.14/bin/python -m tests.zoo.runner --models $(ZOO_VISION) --json .cache/zoo/rows-2.14.json

clean:
	rm -rf $(VENV) .venv-* build *.egg-info
