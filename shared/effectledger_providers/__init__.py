"""Provider knowledge shared by the dispatcher and the reconciler.

`adapters`: how one tool's request is built and its answers are read (no I/O).
`calls`: one HTTP attempt classified into an outcome, and readback, over aiohttp
(`session`: the one place the provider client is built).
"""
