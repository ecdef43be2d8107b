"""OpenAI's Responses API over the chat machinery: the request body (`protocol`), input items to chat
turns and replies to output items (`items`), one response's generation and events (`run`), and the
server's memory of responses (`store`). The routes are in `routes/responses.py`."""
