# session 26, call 13 (carries vllm-c + unpack.sh; a fresh machine): source .devkit/unpack.sh
# session 26, call 14 (carries vllm-deps + unpack.sh; same machine): source .devkit/unpack.sh
