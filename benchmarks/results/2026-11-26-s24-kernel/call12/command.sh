# session 24, call 12 (carries vllm-c + unpack.sh): source .devkit/unpack.sh
