"""The OpenAI-compatible endpoints' parts (the routes are gateway/routes/oai.py): the request and
response formats (format) and the tokenizer's work off the event loop (tokenizer_work)."""
