# Sourced by the fine-tuning benchmarks: `lora_section RANK ALPHA` prints the [lora] section that
# adapts every projection of the block (peft's "all-linear" for a Llama-style model).
lora_section() {
  printf '[lora]\nrank = %s\nalpha = %s\ntargets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]\n' "$1" "$2"
}
