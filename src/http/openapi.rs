//! The OpenAPI 3.1 document: every route, parameter, schema and error.
//! `taskgate openapi` prints it; `openapi/openapi.json` is its committed
//! copy, and a test fails when they differ.

use utoipa::{
    Modify, OpenApi, PartialSchema, ToSchema,
    openapi::{
        ContentBuilder, OpenApi as Doc, Ref, RefOr, ResponseBuilder,
        path::Operation,
        schema::{ObjectBuilder, Schema, Type},
    },
};

use super::{allocations, barriers, error, events, semaphores, service, tasks, views};
use crate::lifecycle::{
    Condition, CoordState, DesiredKind, Hook, ListState, Outcome, RunState, Stage, StopKind,
    TroubleKind, WaitFor, Why,
};

/// String-enum schemas for the lifecycle enums, with their values taken
/// from the enums' own name tables.
macro_rules! name_schema {
    ($($ty:ty => $doc:literal),+ $(,)?) => {$(
        impl PartialSchema for $ty {
            fn schema() -> RefOr<Schema> {
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(<$ty>::ALL.iter().map(|v| v.as_str())))
                    .description(Some($doc))
                    .into()
            }
        }
        impl ToSchema for $ty {}
    )+};
}

name_schema! {
    CoordState => "The coordinator state; it decides which stage gates are open.",
    Stage => "The gate a task listens on, derived from its lifecycle.",
    Hook => "When a task runs relative to the main tasks.",
    RunState => "A task's reported state.",
    StopKind => "Why a task is told to stop.",
    DesiredKind => "What a task should be doing.",
    WaitFor => "What a task in `waiting_on` is waited on for: `pending` (after an all-tasks restart), `success` (a prestart task), `running` (a prestart sidecar; a main task to start), `ready` (a task that declares readiness), `dead`, `dependency` (its gate is open but a dependency does not hold).",
    Condition => "What a dependency waits for its target task to be: `running`, `ready` (running and ready), `succeeded` (dead, not failed), `dead` (failed or not).",
    Why => "Why a dependency does not hold: its target is `not_registered` (no such allocation), `no_such_task` (the allocation is held and has no task of that name), `pending`, `running`, `dead`, `failed`, `not_ready`, or the dependency leads back to its own task (`cycle`).",
    Outcome => "How the allocation ended: `failed` when a non-poststop task failed, else `succeeded`.",
    TroubleKind => "What needs an operator's eye, most severe first: `lost` (a task's agent fell silent past its TTL), `failed` (a task ended failed, and no all-tasks restart was ordered since), `past_deadline` (a stage's deadline passed), `stuck` (a task may start but for a dependency that will not hold by itself: its target ended or failed, has no such task, or the dependencies form a cycle), `blocked` (a task may start but for a dependency on another allocation that does not hold yet).",
    ListState => "Which allocations a list shows: `running` (some task not dead), `finished` (every task dead), `failed` (a task failed or was lost, or a deadline passed), `lost` (a task was lost), `blocked` (a task is held by a dependency: `blocked` or `stuck`).",
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "taskgate",
        description = "Nomad's task lifecycle coordinator as a service: agents report task \
states and long-poll for permission to start; operators restart and restore. \
Errors are RFC 9457 problem documents with a stable `code`.",
    ),
    paths(
        allocations::list,
        allocations::register,
        allocations::get,
        allocations::timeline,
        events::stream,
        allocations::delete,
        allocations::report_batch,
        allocations::restart,
        allocations::restore,
        allocations::stop,
        tasks::get,
        tasks::report,
        tasks::start_condition,
        tasks::heartbeat,
        semaphores::list,
        semaphores::put,
        semaphores::get,
        semaphores::delete,
        barriers::get,
        service::root,
        service::health,
        service::metrics,
        service::openapi_json,
        service::errors,
    ),
    components(schemas(
        error::Problem,
        error::ProblemField,
        views::HealthView,
        super::dto::SemaphoreNameBody
    )),
    modifiers(&CommonResponses),
    tags(
        (name = "allocations", description = "Register, read, list, restart, restore, stop and delete allocations"),
        (name = "tasks", description = "Task views, state reports and the start-condition long-poll"),
        (name = "semaphores", description = "At most N tasks at once, across allocations: create, read, list and delete semaphores"),
        (name = "barriers", description = "Tasks of several allocations that start together: read a barrier's members"),
        (name = "service", description = "Health, metrics and this document"),
    )
)]
pub struct ApiDoc;

/// Adds the errors every route can answer, so no handler repeats them:
/// 400 `invalid_request` (path identifiers, query parameters), 404 for
/// unknown routes, 421 `host_not_allowed`, 500 `internal`, 503 `starting`;
/// on routes with a body also 400 `invalid_json`, 413 and 415; on writes
/// 403 `cross_site_request`.
struct CommonResponses;

fn problem(description: &str) -> utoipa::openapi::Response {
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/problem+json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name(error::Problem::name())))
                .build(),
        )
        .build()
}

fn add(op: &mut Operation, status: &str, description: &str) {
    op.responses
        .responses
        .entry(status.to_owned())
        .or_insert_with(|| problem(description).into());
}

/// `add`, or a route's own answer of that status told about one more case.
fn add_case(op: &mut Operation, status: &str, description: &str) {
    match op.responses.responses.get_mut(status) {
        Some(RefOr::T(response)) => {
            response.description = format!("{}; {description}", response.description);
        }
        Some(RefOr::Ref(_)) => {}
        None => add(op, status, description),
    }
}

/// Routes that never need a token.
const PUBLIC: &[&str] = &["/", "/v1/health", "/openapi.json", "/errors"];

impl Modify for CommonResponses {
    fn modify(&self, doc: &mut Doc) {
        use utoipa::openapi::security::{
            Http, HttpAuthScheme, SecurityRequirement, SecurityScheme,
        };
        let mut scheme = Http::new(HttpAuthScheme::Bearer);
        scheme.description = Some(
            "A token of role operator, agent or reader, as `Authorization: Bearer <token>` \
             (or `X-Taskgate-Token: <token>`): a configured secret, or a JWT (RS256 or ES256) \
             of an issuer the server trusts (`--jwt-issuers`: a Kubernetes service-account \
             token, a Nomad workload identity), verified against the issuer's keys and given \
             the issuer's role and the allocation prefixes its claims name. Needed when the \
             server has tokens or issuers configured."
                .into(),
        );
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme("token", SecurityScheme::Http(scheme));
        for (path, item) in doc.paths.paths.iter_mut() {
            let public = PUBLIC.contains(&path.as_str());
            let ops = [
                (&mut item.get, false),
                (&mut item.put, true),
                (&mut item.post, true),
                (&mut item.delete, true),
            ];
            // A heartbeat commits nothing: no store failure reaches it,
            // but a lease renewal etcd does not acknowledge does.
            let heartbeat = path.ends_with("/heartbeat");
            let commits = !heartbeat;
            for (op, changes) in ops {
                let Some(op) = op else { continue };
                let writes = changes && commits;
                let has_body = op.request_body.is_some();
                if has_body {
                    add(
                        op,
                        "400",
                        "`invalid_json`: the body is not JSON or does not match the schema; \
                         `invalid_request`: it breaks a rule, or a path identifier or query \
                         parameter is bad (see `errors`)",
                    );
                    add(op, "413", "`payload_too_large`: the body is over the limit");
                    add(
                        op,
                        "415",
                        "`unsupported_media_type`: the body is not sent as application/json",
                    );
                } else {
                    add(
                        op,
                        "400",
                        "`invalid_request`: a path identifier or query parameter is bad (see `errors`)",
                    );
                }
                if !public {
                    op.security = Some(vec![SecurityRequirement::new(
                        "token",
                        Vec::<String>::new(),
                    )]);
                    add(
                        op,
                        "401",
                        "`unauthorized`: the token is missing or unknown, or a JWT that does \
                         not verify (its detail says why)",
                    );
                    add(
                        op,
                        "403",
                        "`forbidden`: the token's role or prefixes do not allow this",
                    );
                }
                if changes {
                    add_case(
                        op,
                        "403",
                        "`cross_site_request`: a browser sent it from a page of another site \
                         (its `Origin` or `Sec-Fetch-Site`), with or without a token",
                    );
                }
                add(
                    op,
                    "421",
                    "`host_not_allowed`: the `Host` names a host the server does not serve (on \
                     a loopback address only loopback names, unless `--allowed-hosts`)",
                );
                if !public && !changes && super::edge::WAITING_ROUTES.contains(&path.as_str()) {
                    add(
                        op,
                        "429",
                        "`quota_exceeded`: the token holds as many waits as it may (a request \
                         holds one only while it waits); with `Retry-After`",
                    );
                }
                add(op, "500", "`internal`: the cause is in the server log");
                add(
                    op,
                    "503",
                    if writes {
                        "`starting`: the store is still loading; `timeout`: a request that does \
                         not wait took longer than the request timeout (a write may still have \
                         been applied); `store_unavailable`: the store takes no writes for now; \
                         `store_failed`: the store failed this write (it may or may not be kept) \
                         or refuses writes after a failed one until a restart; all with \
                         `Retry-After`"
                    } else if heartbeat && changes {
                        "`starting`: the store is still loading; `timeout`: a request that does \
                         not wait took longer than the request timeout; `store_unavailable`: \
                         (`--store etcd`) etcd acknowledges no lease renewal now, so the sign of \
                         life was heard but cannot be kept for the TTL: send it again; all with \
                         `Retry-After`"
                    } else {
                        "`starting`: the store is still loading; `timeout`: a request that does \
                         not wait took longer than the request timeout (a write may still have \
                         been applied); both with `Retry-After`"
                    },
                );
                if !public {
                    add_case(
                        op,
                        "503",
                        "`jwt_keys_unavailable`: a JWT whose key its issuer's keys lack, while \
                         they cannot be read again for it (its key may be newer); with \
                         `Retry-After`",
                    );
                }
            }
        }
    }
}

/// The identifier syntax, as a JSON Schema pattern.
const ID_PATTERN: &str = "^[A-Za-z0-9][A-Za-z0-9._-]*$";

/// Constraints utoipa's attributes cannot state, set on the JSON form:
/// task names as the keys of a batch, the detail count of an event.
fn refine(doc: &mut serde_json::Value) {
    let schemas = &mut doc["components"]["schemas"];
    schemas["BatchBody"]["properties"]["tasks"]["propertyNames"] = serde_json::json!({
        "type": "string", "minLength": 1, "maxLength": 128, "pattern": ID_PATTERN
    });
    schemas["EventBody"]["properties"]["details"]["maxProperties"] = 32.into();
    // Rules across fields, stated so that schema-valid requests are
    // accepted: at most one leader; no sidecar on poststop; `task` and
    // `all_tasks: true` not together.
    schemas["RegisterBody"]["properties"]["tasks"]["contains"] = serde_json::json!({
        "type": "object", "required": ["leader"], "properties": {"leader": {"const": true}}
    });
    schemas["RegisterBody"]["properties"]["tasks"]["minContains"] = 0.into();
    schemas["RegisterBody"]["properties"]["tasks"]["maxContains"] = 1.into();
    // Names must be unique, which JSON Schema cannot say of one property;
    // identical tasks at least are excluded here, and the contract run's
    // hook (scripts/contract/hooks.py) keeps repeated names out.
    schemas["RegisterBody"]["properties"]["tasks"]["uniqueItems"] = true.into();
    schemas["LifecycleBody"]["if"] = serde_json::json!({
        "required": ["hook"], "properties": {"hook": {"const": "poststop"}}
    });
    schemas["LifecycleBody"]["then"] = serde_json::json!({
        "properties": {"sidecar": {"const": false}}
    });
    schemas["RestartBody"]["not"] = serde_json::json!({
        "required": ["task", "all_tasks"],
        "properties": {"task": {"type": "string"}, "all_tasks": {"const": true}}
    });
    let paths = doc["paths"].as_object_mut().expect("paths is an object");
    for (path, item) in paths.iter_mut() {
        let ops = item.as_object_mut().expect("a path item is an object");
        let params = ops
            .values_mut()
            .filter_map(|op| op.get_mut("parameters")?.as_array_mut())
            .flatten();
        for p in params {
            match p["name"].as_str() {
                Some("index") => p["schema"]["maximum"] = super::params::MAX_INDEX.into(),
                Some("prefix") if path == "/v1/allocations" => {
                    p["schema"] = serde_json::json!({
                        "type": "string", "maxLength": 128,
                        "pattern": "^([A-Za-z0-9][A-Za-z0-9._-]*)?$"
                    });
                }
                _ => {}
            }
        }
    }
}

/// The document as committed: pretty JSON with a final newline.
pub fn document() -> String {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).expect("the OpenAPI document serializes");
    refine(&mut doc);
    let mut s = serde_json::to_string_pretty(&doc).expect("JSON serializes");
    s.push('\n');
    s
}
