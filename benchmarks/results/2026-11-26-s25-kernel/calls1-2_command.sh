# session 25, call 1 (carries vllm-c + unpack.sh): source .devkit/unpack.sh
# session 25, call 2 (carries vllm-deps + unpack.sh; same machine): source .devkit/unpack.sh
