# session 25, call 6 (carries vllm-c + unpack.sh; a fresh machine): source .devkit/unpack.sh
# session 25, call 7 (carries vllm-deps + unpack.sh; same machine): source .devkit/unpack.sh
