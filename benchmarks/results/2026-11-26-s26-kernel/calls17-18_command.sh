# session 26, call 17 (carries vllm-c + unpack.sh; a fresh machine): source .devkit/unpack.sh
# session 26, call 18 (carries vllm-deps + unpack.sh; same machine): source .devkit/unpack.sh
