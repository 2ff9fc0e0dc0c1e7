#!/usr/bin/env bash
# Download the wheels the GPU device lacks, for its Python (3.12, x86-64 manylinux),
# into .whl/serve (the server, GGUF, the tests' OpenAI client, ruff) and .whl/fi
# (FlashInfer and its TVM-FFI runtime). Run on a developer machine, in the repo root;
# the device call then carries `.whl`. See docs/gpu.md.
#
#   bash benchmarks/gpu_wheels.sh        # then: du -sh .whl  (about 28 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"  # never committed
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
    manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
get() {
    local dir=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$dir" "$@"
}
rm -rf .whl
# versions: those the CPU suite runs with here; the device has anyio, h11, httpx,
# click, idna, annotated-doc, numpy, pyyaml, requests, tqdm, einops, ninja,
# nvidia-ml-py, packaging, tabulate already (docs/KINDS list)
get .whl/serve fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 \
    typing-inspection==0.4.2 annotated-types==0.8.0 opentelemetry-api==1.45.2 \
    uvicorn==0.54.0 pyzmq==27.3.0 gguf==0.19.0 openai==3.54.0 httpx2==2.16.2 \
    httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
    typing-extensions==4.16.0 ruff==0.17.6
# 0.5.3: 7 MB and imports without nvidia-cutlass-dsl / nvidia-cudnn-frontend (which it
# lists but loads only for kernels Medha does not call); 0.6.x is 18 MB, 0.7.x 62 MB
get .whl/fi flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2
du -sh .whl/serve .whl/fi .whl
