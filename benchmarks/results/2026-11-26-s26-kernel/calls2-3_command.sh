# session 26, call 2 (carries vllm-c + unpack.sh; a fresh machine): source .devkit/unpack.sh
# session 26, call 3 (carries vllm-deps + unpack.sh; same machine): source .devkit/unpack.sh
