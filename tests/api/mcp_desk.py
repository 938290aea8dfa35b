# A small MCP server built with the reference Python SDK (PyPI `mcp` 1.x, FastMCP), for the
# MCP tests: `python3 mcp_desk.py http <log> <port>` (streamable HTTP on 127.0.0.1) or
# `python3 mcp_desk.py stdio <log>`. Every call is appended to <log> with the idempotency
# key assistd sends in `_meta` (and its `traceparent`, when there is one) and the server's pid.
import os
import sys

import anyio
from pydantic import BaseModel
from mcp.server.fastmcp import Context, FastMCP
from mcp.types import ServerNotification, ToolAnnotations, ToolListChangedNotification

transport, log = sys.argv[1], sys.argv[2]
port = int(sys.argv[3]) if transport == "http" else 0
mcp = FastMCP("desk", host="127.0.0.1", port=port)
READ_ONLY = ToolAnnotations(readOnlyHint=True)


def record(ctx, line):
    meta = ctx.request_context.meta
    extra = (meta.model_extra or {}) if meta else {}
    key = extra.get("io.assistd/idempotency-key")
    # W3C Trace Context in `_meta` (SEP-414), sent while assistd exports traces.
    trace = f" traceparent={extra['traceparent']}" if "traceparent" in extra else ""
    with open(log, "a") as f:
        f.write(f"{line} key={key}{trace} pid={os.getpid()}\n")


@mcp.tool(annotations=READ_ONLY)
def lookup(ticket: str, ctx: Context) -> str:
    """Looks a ticket up."""
    record(ctx, f"lookup {ticket}")
    return f"{ticket} is open"


@mcp.tool(annotations=ToolAnnotations(destructiveHint=True))
def send(to: str, text: str, ctx: Context) -> str:
    """Sends a message to someone."""
    record(ctx, f"send {to} {text}")
    return "sent"


@mcp.tool(annotations=ToolAnnotations(destructiveHint=True))
async def slow_send(to: str, ctx: Context) -> str:
    """Sends a message, slowly."""
    record(ctx, f"slow_send {to}")
    await anyio.sleep(60)
    return "sent"


@mcp.tool(annotations=READ_ONLY)
async def slow_lookup(ticket: str, ctx: Context) -> str:
    """Looks a ticket up; the first call hangs."""
    first = not any(l.startswith("slow_lookup") for l in open(log)) if os.path.exists(log) else True
    record(ctx, f"slow_lookup {ticket}")
    if first:
        await anyio.sleep(60)
    return f"{ticket} is open"


@mcp.tool(annotations=READ_ONLY)
def broken(ticket: str, ctx: Context) -> str:
    """Always fails."""
    record(ctx, f"broken {ticket}")
    raise ValueError(f"no such ticket {ticket}")


class Ticket(BaseModel):
    id: str


@mcp.tool(annotations=ToolAnnotations(idempotentHint=True, destructiveHint=False))
def create_ticket(title: str, ctx: Context) -> Ticket:
    """Opens a ticket."""
    record(ctx, f"create_ticket {title}")
    return Ticket(id="T-7")


@mcp.tool(annotations=ToolAnnotations(destructiveHint=True))
def delete_ticket(id: str, ctx: Context) -> str:
    """Deletes a ticket."""
    record(ctx, f"delete_ticket {id}")
    return "deleted"


@mcp.tool(annotations=READ_ONLY)
def env_keys(ctx: Context) -> str:
    """The names in this server's environment."""
    record(ctx, "env_keys")
    return ",".join(sorted(os.environ))


@mcp.tool(annotations=READ_ONLY)
def gone(ctx: Context) -> str:
    """A tool that `grow` takes away."""
    record(ctx, "gone")
    return "still here"


def extra(ctx: Context) -> str:
    """A tool that `grow` adds."""
    record(ctx, "extra")
    return "extra"


@mcp.tool(annotations=READ_ONLY)
async def grow(ctx: Context) -> str:
    """Adds `extra`, removes `gone`, and says the list changed."""
    record(ctx, "grow")
    mcp.add_tool(extra, annotations=READ_ONLY)
    mcp.remove_tool("gone")
    await ctx.session.send_notification(
        ServerNotification(ToolListChangedNotification()),
        related_request_id=ctx.request_id,
    )
    return "grown"


with open(log + ".starts", "a") as f:
    f.write(f"{os.getpid()}\n")
mcp.run(transport="streamable-http" if transport == "http" else "stdio")
