"""Online serving benchmark: an asyncio client for OpenAI-compatible and SGLang-native servers.

Entry point: ``python benchmark/online/bench_serving.py --help``.
"""
