"""Server-side logic shared by both engines' extensions (imports FastAPI, never an engine)."""
