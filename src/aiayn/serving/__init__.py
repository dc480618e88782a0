"""`aiayn serve`: continuous batching without HTTP (batcher; its lane processes: lanes, and
what the server reads of their pipes: pipes), the loaded model and its answers (service),
the plain ASGI pieces before FastAPI (asgi: the body limit, the fast path of POST
/translate, errors' answers), and the FastAPI app and command (app, with the page in
static/).

May import: aiayn.errors, aiayn.util, aiayn.config, aiayn.model, aiayn.data, aiayn.runs,
aiayn.inference, aiayn.inspect.
"""
