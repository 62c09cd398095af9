"""The chat web app (layer 7): a page, a JSON + streaming API, sessions in SQLite.

`create_chat_app(server_url, store)` builds the FastAPI app for a layer-6 model server;
`start_chat(server_url, db=...)` runs it in a background thread (tests, scripts);
`main(argv)` is `stack chat`.
"""
from .app import COOKIE, create_chat_app
from .launch import ChatHandle, main, start_chat

__all__ = ["COOKIE", "ChatHandle", "create_chat_app", "main", "start_chat"]
