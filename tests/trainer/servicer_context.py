"""Calling a trainer servicer method in-process, as gRPC would: `context.abort` raises `Aborted`
with the status code and details kept on the context."""


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)
