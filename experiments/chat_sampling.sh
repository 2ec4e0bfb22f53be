#!/usr/bin/env bash
# How often SmolLM2-135M-Instruct (the shared Q4_1 GGUF) answers three simple questions right under
# several sampling settings: 32 answers each (seeds 1337..1368, one batch), the first 10 tokens.
# Usage: experiments/chat_sampling.sh [EMBER_BINARY] (run from the repository root; ../shared holds the model).
set -euo pipefail
ember=${1:-target/release/ember}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$ember" import ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf --out "$dir/smol" >/dev/null 2>&1
ask() { # question, pattern, flags...
    local q=$1 pattern=$2
    shift 2
    local args=()
    for _ in $(seq 32); do args+=(--prompt "$q"); done
    # Answers counted once each: the text of each `=== i ===` block after its prompt line.
    "$ember" sample --checkpoint "$dir/smol" --chat --max-new-tokens 10 "${args[@]}" "$@" \
        | awk -v RS='=== [0-9]+ ===' -v pat="$pattern" \
            'NR > 1 { sub(/^\n[^\n]*\n/, ""); if (tolower($0) ~ pat) n++ } END { print n + 0 }'
}
printf '| setting | capital of France (Paris) | 2 + 2 (4) | a primary colour |\n|---|---|---|---|\n'
for setting in "--temperature 0" "--temperature 0.2 --top-p 0.9" "--temperature 0.4 --top-p 0.9" \
    "--temperature 0.6 --top-p 0.9" "--temperature 0.7 --top-p 0.9" "--temperature 0.8 --top-k 200 --top-p 1" \
    "--temperature 0.8 --top-k 40 --top-p 0.95"; do
    # No top-k unless the setting names one (sample's own default is 200).
    [[ $setting == *--top-k* ]] && flags=$setting || flags="$setting --top-k 0"
    # shellcheck disable=SC2086
    printf '| `%s` | %s/32 | %s/32 | %s/32 |\n' "$setting" \
        "$(ask 'What is the capital of France?' 'paris' $flags)" \
        "$(ask 'What is 2 + 2?' '(^|[^0-9])4([^0-9]|$)|four' $flags)" \
        "$(ask 'Name a primary colour.' 'red|blue|yellow' $flags)"
done
