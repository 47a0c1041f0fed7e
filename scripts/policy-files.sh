#!/usr/bin/env bash
# Counts, for each policy, the files under src/ and kernels/ that hold its code (issue 31, acceptance 4).
#
# Rule: a file holds policy P's code when a line of it that is not a comment (`//`, `///`, `//!` lines are
# dropped, and the text after `//` on any line) names P by one of P's identifiers (the patterns below:
# type and module names, kernel names, the policy's own macros). Everything under src/ (*.rs) and
# kernels/ (*.cu, *.cuh) is read, including `#[cfg(test)]` blocks inside those files; tests/, crates/,
# docs/, python_shim/ and data files are not. A file in another policy's own place (src/policy/<Q>/,
# kernels/policy/<Q>.cu) that names P is using P's shared code, and is listed under "uses" but not
# counted for P. The count is split into P's own places, the registry (src/policy/registry.rs: one line per
# policy and table, its kernel files' modules included) and everything else.
#
# Usage: scripts/policy-files.sh [-v] [REPO_DIR]   (-v lists the files; REPO_DIR defaults to .)
set -eu  # no pipefail: `grep -q` closes the pipe early
verbose=0
if [[ "${1:-}" == "-v" ]]; then verbose=1; shift; fi
root="${1:-.}"
cd "$root"

declare -A pat=(
  [streaming]='[Ss]treaming'
  [quest]='\b[Qq]uest|_[Qq]uest|[a-z0-9]Quest|QUEST|QSEL'  # not inside a word: "requested" is no Quest code
  [snapkv]='[Ss]nap[Kk][Vv]|\bsnap_|\bSnap[A-Z]|\bSNAP_|kvs_snap'
  [speculate]='[Ss]peculat|\bprr|\bPrr|\bPRR|_prr'
  [refresh]='[Rr]efresh[A-Z_(: ]|\bRefresh\b|REFRESH|\bRF_|kvs_refresh'
  [predictor]='[Pp]redictor|\bPRED_|kvs_pred|\bPred[A-Z]|\bpred_'
  [top_p]='top_p|\bTopP|\btopp|\bTOPP'
  [art]='\b(art|Art|ART)(_|\b|[A-Z])|_art\b|_art_'
)
order=(streaming quest snapkv speculate refresh predictor top_p art)

# A policy's own places (a file there counts for it and only for it).
own() { # policy file
  local p="$1" f="$2"
  case "$f" in
    src/policy/"$p"/*|kernels/policy/"$p".cu|kernels/policy/"$p"/*) return 0 ;;
  esac
  [[ "$p" == speculate && "$f" == kernels/policy/speculate.cu ]] && return 0
  return 1
}
foreign() { # policy file: in another policy's own place
  local p="$1" f="$2" q
  for q in "${order[@]}"; do
    [[ "$q" == "$p" ]] && continue
    own "$q" "$f" && return 0
  done
  return 1
}

files=$(find src kernels -type f \( -name '*.rs' -o -name '*.cu' -o -name '*.cuh' \) | sort)
printf '%-10s %5s %4s %8s %9s  %s\n' policy files own registry elsewhere "uses (files in another policy's folder naming it)"
for p in "${order[@]}"; do
  n=0; u=0; o=0; r=0; list=(); ulist=()
  for f in $files; do
    if sed -e 's#^[[:space:]]*//.*$##' -e 's#//.*$##' "$f" | grep -Eq "${pat[$p]}" || { own "$p" "$f"; }; then
      if foreign "$p" "$f"; then u=$((u + 1)); ulist+=("$f"); else
        n=$((n + 1)); list+=("$f")
        if own "$p" "$f"; then o=$((o + 1)); fi
        case "$f" in src/policy/registry.rs) r=$((r + 1)) ;; esac
      fi
    fi
  done
  printf '%-10s %5d %4d %8d %9d  %d\n' "$p" "$n" "$o" "$r" $((n - o - r)) "$u"
  if ((verbose)); then
    for f in "${list[@]}"; do echo "    $f"; done
    for f in "${ulist[@]:-}"; do [[ -n "$f" ]] && echo "    (uses) $f"; done
  fi
done
