# The two commands: `make demo` and `make test`. Both create .venv and install what is missing.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test deps system proto bench clean

demo: deps
	$(PY) examples/demo.py

test: deps
	$(PY) -m pytest -q -p no:cacheprovider

deps: system $(STAMP)

system:
	@bash scripts/install-system-deps.sh

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first, pinned: on these machines 2.13.0 is a local CPU wheel.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[server,dev]'
	touch $@

proto: deps
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. torchfarm/proto/torchfarm.proto

bench: deps
	$(PY) bench/warm_start.py

clean:
	rm -rf $(VENV) build *.egg-info
