#!/usr/bin/env bash
# Apply megatron_hdp's patch to Megatron-LM's pretrain_gpt.py: tag core_v0.19.0 (megatron-core 0.19.x) or
# main (megatron-core 0.20.0); the same patch fits both (main's hunks sit 13 lines lower).
#
#   patches/apply.sh [--check] /path/to/Megatron-LM
#
# 1. looks pretrain_gpt.py's sha256 up in pretrain_gpt.py.sha256 (the upstream files the patch was
#    checked on) and says which one it is (an unknown file is only a warning: the dry run below decides),
# 2. dry-runs the patch (`patch --dry-run`; nothing is written if any hunk fails),
# 3. applies it, unless --check was given. A checkout already patched is reported and left alone.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
patch_file="$here/pretrain_gpt.patch"
known_shas="$here/pretrain_gpt.py.sha256"  # lines: <sha256>  <release>

check_only=0
if [[ "${1:-}" == "--check" ]]; then check_only=1; shift; fi
if [[ $# -ne 1 ]]; then
    echo "usage: $0 [--check] /path/to/Megatron-LM" >&2
    exit 2
fi
target="$1/pretrain_gpt.py"
if [[ ! -f "$target" ]]; then
    echo "error: $target not found; pass the root of a Megatron-LM checkout (tag core_v0.19.0 or main)" >&2
    exit 2
fi

if patch --dry-run --reverse --force --silent -p1 -d "$1" < "$patch_file" > /dev/null 2>&1; then
    echo "$target already has the megatron_hdp patch; nothing to do"
    exit 0
fi

actual_sha="$(sha256sum "$target" | cut -d' ' -f1)"
release="$(awk -v sha="$actual_sha" '$1 == sha { print $2 }' "$known_shas")"
if [[ -n "$release" ]]; then
    echo "$target is Megatron-LM $release's pretrain_gpt.py"
else
    echo "warning: $target is none of the pretrain_gpt.py files the patch was checked on ($(awk '{ print $2 }' "$known_shas" | paste -sd, -); sha256 $actual_sha); trying anyway" >&2
fi

if ! patch --dry-run --forward --silent -p1 -d "$1" < "$patch_file"; then
    echo "error: the patch does not apply to $target; use examples/pretrain_gpt_hdp.py instead, or apply the three" >&2
    echo "       changes by hand (see patches/README.md)" >&2
    exit 1
fi
echo "patch applies cleanly to $target"
if [[ $check_only -eq 1 ]]; then exit 0; fi
patch --forward --silent --no-backup-if-mismatch -p1 -d "$1" < "$patch_file"  # no .orig on main's offset hunks
echo "patched $target"
