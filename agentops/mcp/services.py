"""The MCP gateway's writes (docs/mcp.md): find or start the run a ``tools/call`` belongs
to, and record the call once. Nothing here calls a tool: the workers do, through the
``mcp-gateway`` agent (``agentops.mcp.gateway``)."""

from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Max

from agentops.mcp import remote
from agentops.mcp.gateway import AGENT_NAME, SIGNAL, exposed_tools
from agentops.mcp.models import GatewayCall, GatewaySession
from runs.actors import DRIVE_REMOTE_RUN, Actor, PermissionDenied
from runs.errors import DomainError, NotFound
from runs.models import ApiToken, Run, Step
from runs.record.checkpoint import checkpoint
from runs.record.eventtypes import EventType
from runs.registry import Tool, digest
from runs.services import InvalidInput, InvalidState, run_create
from runs.waits import run_signal

CLIENT_KEY_MAX = 200
# a session is bound to a run by whichever request gets there first; losers re-read
SESSION_BIND_ATTEMPTS = 5


class ToolNotOffered(PermissionDenied):
    """The tool is not offered to this principal (not exposed, or not in its groups)."""

    code = "tool_not_offered"
    status = 403


class KeyReused(InvalidState):
    """The client's idempotency key was used before for another tool or other arguments."""

    code = "idempotency_key_reused"
    status = 409


class RunNotFound(NotFound):
    pass


class GatewayBusy(DomainError):
    """This gateway process holds as many ``tools/call`` requests as it may
    (``AGENTOPS_MCP_MAX_HELD``): nothing was recorded; call again after ``retry_after``."""

    code = "gateway_busy"
    status = 429
    RETRY_AFTER = 5

    def __init__(self) -> None:
        super().__init__(
            "This MCP gateway process holds as many calls as it may; nothing was recorded. "
            "Call again (the same key) after retry_after seconds."
        )

    @property
    def extra(self) -> dict[str, Any]:
        return {"retry_after": self.RETRY_AFTER}


def gateway_actor(token: ApiToken) -> Actor:
    """Who the gateway's events name: the token, as for the API (channel ``api``). The
    token's principal was checked (``gateway_require``) before the gateway acts for it; the
    run services it calls then act on the record's own rules, as for a worker."""
    return Actor(label=f"token:{token.name}", channel="api")


def gateway_require(user: Any) -> None:
    """Only the agent role uses the gateway: service accounts that drive agents, and nothing
    an operator does (docs/api.md)."""
    if not (user is not None and user.is_active and user.has_perm(DRIVE_REMOTE_RUN)):
        raise PermissionDenied("the MCP gateway takes tokens of the agent role only")


def tools_for(user: Any) -> list[Tool]:
    """The tools ``user`` may call through the gateway: the exposed ones and the offered
    remote agents' manifest tools (``agentops.mcp.remote``) whose ``allowed_groups`` (if any)
    include one of the user's groups."""
    groups = set(user.groups.values_list("name", flat=True))
    return [
        tool
        for tool in [*exposed_tools(), *remote.remote_tools()]
        if not tool.allowed_groups or user.is_superuser or groups & set(tool.allowed_groups)
    ]


def call_digest(tool_name: str, arguments: Any) -> str:
    return digest({"tool": tool_name, "arguments": arguments})


def gateway_call_record(
    *,
    token: ApiToken,
    tool_name: str,
    arguments: dict[str, Any],
    client_key: str = "",
    run_id: str = "",
    session: str = "",
    dry_run: bool = False,
) -> GatewayCall:
    """The recorded call for this ``tools/call``: the one recorded before under the same key
    (the client's, or the arguments' digest within the run), or a new one, recorded and
    its run woken. Asking again is always safe: it never records or dispatches twice.
    ``dry_run``: the call goes into a dry run of the gateway (its own run per session), where
    a tool that is not read only says what it would do (docs/mcp.md, "Dry runs")."""
    user = token.principal
    gateway_require(user)
    tool = next((t for t in tools_for(user) if t.name == tool_name), None)
    if tool is None:
        raise ToolNotOffered(f"no tool {tool_name!r} is offered to {user.get_username()}")
    if not isinstance(arguments, dict):
        raise InvalidInput("arguments must be an object")
    if not isinstance(client_key, str) or len(client_key) > CLIENT_KEY_MAX:
        raise InvalidInput(f"an idempotency key is a string of at most {CLIENT_KEY_MAX} characters")
    errors = tool.validate(arguments)
    if errors:
        raise InvalidInput("arguments do not match the tool's schema: " + "; ".join(errors))
    arguments_digest = call_digest(tool_name, arguments)
    # a remote agent's manifest tool: the call goes into a run of that agent, whose own
    # process carries it out (agentops.mcp.remote); any other into a run of the gateway's
    agent_name = remote.agent_of(tool_name) or AGENT_NAME
    if dry_run and agent_name != AGENT_NAME:
        raise InvalidState(
            f"{tool_name} is a remote agent's tool: the gateway offers no dry run of it"
        )

    if client_key:
        found = _by_client_key(user, client_key, tool_name, arguments_digest)
        if found is not None and found.run.dry_run != dry_run:
            # a real call's key must never answer a dry run's, nor the other way round
            raise KeyReused("this idempotency key was already used in a " + _mode(found.run))
        if found is not None:
            _wake(token, found)
            return found
    run = _run_for(token, run_id=run_id, session=session, dry_run=dry_run, agent_name=agent_name)
    if not client_key:
        found = GatewayCall.objects.filter(
            run=run, client_key="", arguments_digest=arguments_digest
        ).first()
        if found is not None:
            _wake(token, found)
            return found
    try:
        call = _record(token, run, tool_name, arguments, arguments_digest, client_key)
    except IntegrityError:
        # the same key recorded at the same moment by another request: that one holds
        if client_key:
            found = _by_client_key(user, client_key, tool_name, arguments_digest)
        else:
            found = GatewayCall.objects.filter(
                run=run, client_key="", arguments_digest=arguments_digest
            ).first()
        if found is None:
            raise
        call = found
    _wake(token, call)
    return call


def _by_client_key(
    user: Any, client_key: str, tool_name: str, arguments_digest: str
) -> GatewayCall | None:
    found = (
        GatewayCall.objects.select_related("run")
        .filter(principal=user, client_key=client_key)
        .first()
    )
    if found is None:
        return None
    if found.tool_name != tool_name or found.arguments_digest != arguments_digest:
        raise KeyReused("this idempotency key was already used for another tool or other arguments")
    if found.run.status in Run.TERMINAL and not _taken(found):
        # its run ended before taking it (the run went idle at that moment): nothing was
        # decided, let alone dispatched, so it is recorded again in a live run
        found.delete()
        return None
    return found


def _taken(call: GatewayCall) -> bool:
    """Whether the run took the call: the gateway agent's ``position``-th tool-call step, or
    the engine call a remote agent's process proposed for it."""
    if call.run.agent_name != AGENT_NAME:
        return remote.tool_call_of(call) is not None
    return (
        Step.objects.filter(run_id=call.run_id, kind=Step.Kind.TOOL_CALL).count() >= call.position
    )


def _mode(run: Run) -> str:
    return "dry run" if run.dry_run else "real run"


def _run_for(
    token: ApiToken,
    *,
    run_id: str,
    session: str,
    dry_run: bool = False,
    agent_name: str = AGENT_NAME,
) -> Run:
    """The run a call goes into: the one the client names, else the live gateway run of
    this principal and session (a session of the MCP transport, or the token when the
    protocol has none), else a new one. A dry run's calls have their own run and binding:
    a call asked as a dry run never goes into a real run (nor the other way round). A remote
    agent's tool: the same, with runs of that agent (bound apart from the gateway's)."""
    user = token.principal
    runs = Run.objects.filter(agent_name=agent_name, principal=user)
    if dry_run:
        session = f"{session[:190]}#dry-run"
    if agent_name != AGENT_NAME:
        session = f"{session[: 198 - len(agent_name)]}#{agent_name}"
    if run_id:
        try:
            run = runs.filter(id=uuid.UUID(str(run_id))).first()
        except ValueError:
            run = None
        if run is None:
            raise RunNotFound(f"no gateway run {run_id} of {agent_name} of {user.get_username()}")
        if run.status in Run.TERMINAL:
            raise InvalidState(f"the run is {run.status}: start another (leave out the run id)")
        if run.dry_run != dry_run:
            raise InvalidState(
                f"run {run.id} is a {_mode(run)}, and this call was asked "
                + ("as a dry run" if dry_run else "for real")
            )
        return run
    for _attempt in range(SESSION_BIND_ATTEMPTS):
        bound = GatewaySession.objects.filter(principal=user, session_key=session).first()
        if bound is not None:
            live = runs.filter(id=bound.run_id).exclude(status__in=Run.TERMINAL).first()
            if live is not None:
                return live
        try:
            # the run and its binding commit together: a concurrent first call of the same
            # session (another gateway process) that binds first makes this one roll back,
            # run and all (its wake-up is sent on commit only), and use that run
            with transaction.atomic():
                run = run_create(
                    agent_name=agent_name,
                    goal=f"MCP calls of {user.get_username()}",
                    # a remote agent's run: its input schema must accept an empty object
                    input={"session": session} if agent_name == AGENT_NAME else {},
                    actor=gateway_actor(token),
                    principal=user,
                    max_steps=settings.AGENTOPS_MCP["MAX_STEPS"],
                    dry_run=dry_run,
                )
                if bound is None:
                    GatewaySession.objects.create(principal=user, session_key=session, run=run)
                elif not GatewaySession.objects.filter(id=bound.id, run_id=bound.run_id).update(
                    run=run
                ):
                    raise _Rebound
            return run
        except (IntegrityError, _Rebound):
            continue
    raise InvalidState("the session's run kept changing under this call: call again")


class _Rebound(Exception):
    """Another request bound the session to a new run first."""


def _record(
    token: ApiToken,
    run: Run,
    tool_name: str,
    arguments: dict[str, Any],
    arguments_digest: str,
    client_key: str,
) -> GatewayCall:
    actor = gateway_actor(token)
    # the run's row lock (checkpoint) serialises the positions of one run's calls
    with transaction.atomic(), checkpoint(run.id, actor=actor.label, channel=actor.channel) as cp:
        if cp.run.status in Run.TERMINAL:
            raise InvalidState(f"the run is {cp.run.status}: start another (leave out the run id)")
        last = GatewayCall.objects.filter(run_id=run.id).aggregate(last=Max("position"))["last"]
        call = GatewayCall.objects.create(
            run_id=run.id,
            position=(last or 0) + 1,
            principal=token.principal,
            tool_name=tool_name,
            arguments=arguments,
            arguments_digest=arguments_digest,
            client_key=client_key,
        )
        cp.event(
            EventType.MCP_CALL_RECEIVED,
            position=call.position,
            tool=tool_name,
            arguments_digest=arguments_digest,
            key="client" if client_key else "digest",
            client_key=client_key or None,
        )
    return call


def _wake(token: ApiToken, call: GatewayCall) -> None:
    """Signal the call's run (idempotent per call): a run waiting for calls is made
    runnable; a busy one finds the call when it next decides. Sent again when the client
    asks again, in case the MCP process died between recording and signalling."""
    run = Run.objects.filter(id=call.run_id).only("status").first()
    if run is None or run.status in Run.TERMINAL or _taken(call):
        return
    run_signal(
        run_id=call.run_id,
        name=SIGNAL,
        payload={"position": call.position},
        actor=gateway_actor(token),
        idempotency_key=f"mcp.call:{call.id}",
    )


def gateway_call_link(*, call_id: int, tool_call_id: int) -> None:
    """Note which engine call a recorded call became (its position already determines it:
    this is for people reading the record, and for the ``gateway_call`` relation)."""
    GatewayCall.objects.filter(id=call_id, tool_call__isnull=True).update(tool_call_id=tool_call_id)
