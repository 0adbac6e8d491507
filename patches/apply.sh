#!/usr/bin/env bash
# Apply megatron_hdp's patch to Megatron-LM's pretrain_gpt.py (release core_v0.19.0 = megatron-core 0.19.x).
#
#   patches/apply.sh [--check] /path/to/Megatron-LM
#
# 1. compares pretrain_gpt.py with the sha256 of the upstream file the patch was written against
#    (a mismatch is only a warning: the dry run below decides),
# 2. dry-runs the patch (`patch --dry-run`; nothing is written if any hunk fails),
# 3. applies it, unless --check was given. A checkout already patched is reported and left alone.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
patch_file="$here/pretrain_gpt.patch"
expected_sha="$(cut -d' ' -f1 "$here/pretrain_gpt.py.sha256")"

check_only=0
if [[ "${1:-}" == "--check" ]]; then check_only=1; shift; fi
if [[ $# -ne 1 ]]; then
    echo "usage: $0 [--check] /path/to/Megatron-LM" >&2
    exit 2
fi
target="$1/pretrain_gpt.py"
if [[ ! -f "$target" ]]; then
    echo "error: $target not found; pass the root of a Megatron-LM checkout (tag core_v0.19.0)" >&2
    exit 2
fi

if patch --dry-run --reverse --force --silent -p1 -d "$1" < "$patch_file" > /dev/null 2>&1; then
    echo "$target already has the megatron_hdp patch; nothing to do"
    exit 0
fi

actual_sha="$(sha256sum "$target" | cut -d' ' -f1)"
if [[ "$actual_sha" != "$expected_sha" ]]; then
    echo "warning: $target is not the core_v0.19.0 file the patch was written against (sha256 $actual_sha); trying anyway" >&2
fi

if ! patch --dry-run --forward --silent -p1 -d "$1" < "$patch_file"; then
    echo "error: the patch does not apply to $target; use examples/pretrain_gpt_hdp.py instead, or apply the three" >&2
    echo "       changes by hand (see patches/README.md)" >&2
    exit 1
fi
echo "patch applies cleanly to $target"
if [[ $check_only -eq 1 ]]; then exit 0; fi
patch --forward --silent -p1 -d "$1" < "$patch_file"
echo "patched $target"
