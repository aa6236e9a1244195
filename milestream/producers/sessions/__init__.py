"""Token-in-token-out chat sessions: chat templates (templates.py, qwen.py), the session tree (tito.py), the HTTP service (server.py)."""
