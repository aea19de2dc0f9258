"""Multi-tenant serving: the KServe v2 inference server (``gpulens serve``) and the open-loop
load generator (``gpulens load``). Import-light: web frameworks and aiohttp are imported where
they are used."""
