# Two commands for a fresh machine:
#   make demo   set everything up, then run a heterogeneous swarm on loopback on the built-in corpus:
#               2 full replicas and a pipeline swarm of 2 stage peers in the same SparseLoCo rounds; then the
#               first replica's model exported to runs/model (Hugging Face format) and a sample of its text;
#               runs/demo/report.html draws the run's rounds
#   make test   set everything up, then run the test suite (what .ci/run calls)
# TORCH_INDEX: pip index for torch when none is installed, e.g. https://download.pytorch.org/whl/cpu
# (leave empty where `pip install torch==2.13.0` already resolves to a CPU build).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
HLBP := $(VENV)/bin/hlbp

IMAGE ?= hlbp:latest
TORCH_WHEELS ?= /opt/wheels

.PHONY: setup demo test lint clean image image-test constraints

setup: $(VENV)/.hlbp-installed

$(VENV)/.hlbp-installed: pyproject.toml setup.py
	@# the light client's libp2p extra builds fastecdsa from source: it needs a C compiler and the GMP headers
	@if ! command -v cc >/dev/null 2>&1 || ! printf '#include <gmp.h>\n' | cc -E -x c - >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing a C compiler and the GMP headers (Debian packages gcc, libgmp-dev) for fastecdsa"; \
	    apt-get update -qq && apt-get install -y -qq gcc libgmp-dev >/dev/null; \
	  else \
	    echo "hlbp needs a C compiler and the GMP headers to build fastecdsa (Debian/Ubuntu: gcc libgmp-dev;" \
	         "Fedora: gcc gmp-devel; macOS: brew install gmp)"; exit 1; \
	  fi; \
	fi
	@# the NAT test (tests/peer/net/test_nat.py) builds home routers in network namespaces with ip and iptables; as
	@# root on Debian/Ubuntu they are installed here, elsewhere the test is skipped and says which is missing
	@if ! { command -v iptables && command -v ip; } >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing iptables and iproute2 (Debian packages) for the NAT test's routers"; \
	  (apt-get install -y -qq iptables iproute2 >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq iptables iproute2 >/dev/null)) \
	    || echo "could not install iptables and iproute2: the NAT test will be skipped"; \
	fi
	@# jemalloc: the peer commands run with it where the system has it (peer/common/allocator.py: a full replica peaks
	@# 2.5-4.5 bytes per parameter lower); as root on Debian/Ubuntu it is installed here, elsewhere glibc's malloc runs
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! ldconfig -p 2>/dev/null | grep -q libjemalloc.so.2; then \
	  echo "installing jemalloc (Debian package libjemalloc2) for the peers' memory"; \
	  (apt-get install -y -qq libjemalloc2 >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libjemalloc2 >/dev/null)) \
	    || echo "could not install libjemalloc2: peers run glibc's malloc"; \
	fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Install the CPU build of torch explicitly when none is present, so no multi-GB CUDA build is pulled.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev,hf,plots,libp2p]"
	touch $@

demo: setup
	rm -rf runs/demo
	$(HLBP) simulate --full 2 --swarms 1 --stages 2 --rounds 8 --out runs/simulate.json --workdir runs/demo
	@# what the swarm trained, outside hlbp: the first replica's checkpoint as a Hugging Face folder, and a sample
	$(HLBP) export runs/demo/peer0/*/*/ runs/model
	$(HLBP) generate runs/demo/peer0/*/*/ --prompt "The king" --max-tokens 40
	@echo "the run's rounds, drawn: runs/demo/report.html"

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=20

# the container image (Dockerfile), built with docker, podman or buildah, whichever this machine has. Build
# arguments through the environment: BASE=IMAGE|local (local: a Debian base made here with debootstrap, no
# registry), TORCH_INDEX=URL|local (local: a torch wheel from TORCH_WHEELS); see docker/image.sh
image:
	IMAGE=$(IMAGE) TORCH_WHEELS=$(TORCH_WHEELS) sh docker/image.sh

# the image built from a local Debian base, then a bootstrap and two replicas run as containers (docker/image_test.py):
# rounds with equal checksums, a stop within Docker's 10 s grace with the checkpoint written, a resume. Not part of
# `make test`: building torch into an image takes longer than the suite
image-test: setup
	IMAGE=$(IMAGE) BASE=$${BASE:-local} TORCH_WHEELS=$(TORCH_WHEELS) \
	  TORCH_INDEX=$${TORCH_INDEX:-$(if $(wildcard $(TORCH_WHEELS)/torch-$(TORCH_VERSION)*-cp311-*.whl),local,)} sh docker/image.sh
	$(PY) docker/image_test.py --image $(IMAGE)

# docker/constraints.txt: the versions this virtualenv holds (the ones the tests passed with), for the image
constraints: setup
	{ echo "# The versions of hlbp's dependencies (and theirs) that the test suite passed with, as the image installs them"; \
	  echo "# (pip install -c). Made by 'make constraints' from the project's virtualenv; torch is pinned by the Dockerfile."; \
	  $(PY) -m pip freeze --exclude-editable | grep -v -E '^(hlbp|torch)=='; } > docker/constraints.txt

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
