#!/usr/bin/env bash
# Builds and downloads, here, the wheels that scripts/gpu_check.sh installs on the GPU machine.
#
# Why: that machine reaches no package index (shared/NOTES.md, "The GPU machine (H200)"). Its
# image ships transformers 5.17 / accelerate 1.15 (older than the versions CI tests, and 5.17
# to 5.22 run module hooks inside the checkpoint) and no DeepSpeed, pydantic or hjson. So the
# packages travel as wheels in .whl/ (git-ignored; the device tool's `carry`), and gpu_check.sh
# installs them with `pip install --no-index --no-deps --target /tmp/site` and PYTHONPATH.
#
#   bash scripts/build_gpu_wheels.sh            # from anywhere; writes <repo>/.whl/
#   bash scripts/build_gpu_wheels.sh --no-hf    # DeepSpeed and its needs only
#
# What goes in:
#   deepspeed            built here as a pure-Python wheel (DS_BUILD_OPS=0: no op is compiled;
#                        its CPU Adam compiles on the GPU machine at first use, which
#                        gpu_check.sh starts in the background at once)
#   hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions
#                        DeepSpeed's needs the image lacks (cp312 manylinux x86-64 wheels)
#   transformers accelerate huggingface_hub httpx2 httpcore2 truststore click hf-xet regex
#   kernels tomlkit      the versions installed here, i.e. what CI tests (skipped with --no-hf)
# Versions are the ones this Python has installed (so CI and the GPU run the same code), except
# DeepSpeed (DS_VERSION, default 0.19.8). Wheels already in .whl/ are kept. Nothing here is a
# dependency of stronghold_hf: DeepSpeed is only ever a peer to compare against.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
PY=${PYTHON:-python3}
DS_VERSION=${DS_VERSION:-0.19.8}
WITH_HF=1
[ "${1:-}" = "--no-hf" ] && WITH_HF=0
mkdir -p "$DEST"
T0=$SECONDS

installed_version() {  # the version of a distribution installed here, or nothing
    "$PY" -c 'import sys; from importlib.metadata import version
try: print(version(sys.argv[1]))
except Exception: pass' "$1"
}

have() {  # have NAME: a wheel of NAME (any spelling of -/_) is already in .whl/
    local norm
    norm=$(echo "$1" | tr '-' '_')
    compgen -G "$DEST/${norm}-*.whl" >/dev/null || compgen -G "$DEST/$1-*.whl" >/dev/null
}

download() {  # download NAME [VERSION]: one cp312 manylinux x86-64 (or pure-Python) wheel
    local name=$1 ver=${2:-}
    [ -z "$ver" ] && ver=$(installed_version "$name")
    if have "$name"; then
        return 0
    fi
    local spec=$name${ver:+==$ver}
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$DEST" "$spec"
    echo "  $spec"
}

echo "deepspeed==$DS_VERSION (pure-Python wheel, DS_BUILD_OPS=0)"
if ! compgen -G "$DEST/deepspeed-$DS_VERSION-*.whl" >/dev/null; then
    # --no-build-isolation: DeepSpeed's setup.py imports torch, which this Python has.
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$DS_VERSION"
fi

echo "DeepSpeed's needs:"
download hjson "${HJSON_VERSION:-3.1.0}"  # not installed here: pinned
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
    download "$name"
done

if [ "$WITH_HF" = 1 ]; then
    echo "transformers and its hub (the versions installed here):"
    for name in transformers accelerate huggingface_hub httpx2 httpcore2 truststore click hf-xet regex kernels tomlkit; do
        download "$name"
    done
fi

# Two versions of one package would stop the install there: refuse them here.
dups=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then
    echo "ERROR: several wheels of: $dups (remove the old ones from $DEST)" >&2
    exit 1
fi
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST, $((SECONDS - T0)) s"
