"""The operator API: `sked service api`, an HTTP/JSON API under /v1 for reading, submitting and
controlling tasks and workflows and for cordoning and draining nodes, behind bearer tokens with
roles (shared/auth.py). ops.py holds the operations table, auth and errors; tasks.py and
nodes.py the handlers; openapi.py the document; service.py the process."""
