#!/usr/bin/env bash
# Checks the code's style and changes nothing:
#   ruff (pyproject.toml's [tool.ruff]: lint rules, then formatting) over the Python of python/, tests/ and
#   scripts/ (not the notebooks), and clang-format (.clang-format) over the C++ and CUDA of csrc/, kernels/
#   and emulation/ (the files git tracks or would track: never a build directory).
#   bash scripts/lint.sh       needs .venv (scripts/setup.sh: the pinned ruff, Debian 12's clang-format 14);
#                              RUFF=... and CLANG_FORMAT=... name other binaries
# One line per failing tool at the end; exit status 1 when any fails. scripts/test.sh runs it before the
# whole suite. To fix: .venv/bin/ruff check --fix python tests scripts && .venv/bin/ruff format python tests
# scripts (then what ruff check still reports, by hand); clang-format -i FILE...
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
RUFF=${RUFF:-.venv/bin/ruff}
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
PY_PATHS=(python tests scripts)
CXX_DIRS=(csrc kernels emulation)
CXX_EXTS=(cpp h cu cuh)
failed=()

if ! "$RUFF" --version > /dev/null 2>&1; then
  failed+=("ruff: $RUFF does not run (bash scripts/setup.sh installs it)")
else
  "$RUFF" check --no-cache --output-format concise "${PY_PATHS[@]}" \
    || failed+=("ruff check: the problems above ([*]: $RUFF check --fix fixes it)")
  "$RUFF" format --no-cache --check --output-format concise "${PY_PATHS[@]}" \
    || failed+=("ruff format: the files above need $RUFF format")
fi

if ! version=$("$CLANG_FORMAT" --version 2> /dev/null); then
  failed+=("clang-format: $CLANG_FORMAT does not run (apt install clang-format)")
else
  [[ "$version" =~ version\ 14\. ]] \
    || echo "lint: $version, not 14 (Debian 12's, the one CI uses): its layout may differ" >&2
  patterns=()
  for d in "${CXX_DIRS[@]}"; do
    for e in "${CXX_EXTS[@]}"; do patterns+=("$d/*.$e"); done
  done
  files=()
  list_sources() {  # the files git tracks or would track; outside a git checkout, every one under CXX_DIRS
    if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
      git ls-files -z --cached --others --exclude-standard -- "${patterns[@]}"
    else
      find "${CXX_DIRS[@]}" -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print0
    fi
  }
  while IFS= read -r -d '' f; do
    [ -f "$f" ] && files+=("$f")  # not one deleted but still in the index
  done < <(list_sources | sort -zu)
  if [ ${#files[@]} -eq 0 ]; then
    failed+=("clang-format: no C++ or CUDA files found under ${CXX_DIRS[*]} (not a git checkout?)")
  elif ! out=$("$CLANG_FORMAT" --dry-run --Werror --ferror-limit=1 "${files[@]}" 2>&1); then
    # One line per file: its first place that clang-format would change.
    bad=$(grep -E '^[^ ].*:[0-9]+:[0-9]+: (error|warning): code should be clang-formatted' <<< "$out")
    if [ -n "$bad" ]; then
      echo "$bad"
      failed+=("clang-format: $(wc -l <<< "$bad") of ${#files[@]} files need $CLANG_FORMAT -i (their lines above)")
    else
      echo "$out"
      failed+=("clang-format: failed (above)")
    fi
  fi
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf 'lint: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "lint: ruff and clang-format find nothing to change" >&2
