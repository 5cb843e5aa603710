# session 26, call 7 (carries vllm-c + unpack.sh; a fresh machine): source .devkit/unpack.sh
# session 26, call 8 (carries vllm-deps + unpack.sh; same machine): source .devkit/unpack.sh
