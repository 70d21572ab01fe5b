"""Upper bounds of the config's count fields (config/schema.py, config/model.py): far beyond any run (Llama 3 405B:
1.2M steps, 15.6T tokens, 128K context), low enough that a slip (1e24 steps, a sequence of 1e8 tokens) is refused
with its key instead of running."""

MAX_STEPS = 10**9
MAX_TOKENS = 10**15
MAX_SEQUENCES = 2**20   # sequences in a batch
MAX_POSITIONS = 2**20   # tokens in a sequence
MAX_VOCAB = 2**24
