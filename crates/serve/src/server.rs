//! The HTTP side: OpenAI's `/v1/completions`, `/v1/chat/completions` (streamed as server-sent
//! events with `stream: true`) and `/v1/models`, and a chat page at `/`.
//!
//! Hardening: the shell ([`ember_http`]) gives it threads of its own, capped request heads, at most
//! [`Limits::max_connections`] connections (503 past it; kept however long an answer waits on the
//! model), bodies announced over [`Limits::max_body`] refused (413) and a `Host` allow-list against
//! DNS rebinding; bodies are read within [`Limits::body_timeout`] (408), an optional API key is
//! required (`Authorization: Bearer …`; the chat page itself is served without it and asks for
//! it), and a full queue is 429. A POST must be JSON (`Content-Type: application/json`, else 415)
//! and, when a browser sends an `Origin`, come from this server's own page (else 403): a web page
//! elsewhere cannot make the user's browser run generations. A client that disconnects
//! mid-answer has its request cancelled at the next token. [`Server::drain`] stops gracefully.
//!
//! Every request is logged (target `ember_serve`): method, route, status, milliseconds and, for
//! generations, the token counts; never the prompt or the answer.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ember_data::finetune::ChatTemplate;
use ember_data::Tokenizer;
use ember_generate::engine::{EngineError, Request as EngineRequest};
use ember_generate::sample::Sampler;
use ember_grammar::{Grammars, Spec};
use ember_http::{race, Conn, Drained, Either, Limits, Priority, Refused, Service, Settings, StartError, Working};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, HOST, ORIGIN, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use crate::answer::{collect, Failed, Shape, Submitted};
use crate::api::{
    chat_fields, completion_fields, error_body, ChatRequest, ChunkHead, CompletionRequest, Format, Generation, Invalid,
    Kind, Prompts, Served, Usage,
};
use crate::chat::ChatPrompt;
use crate::stream::{Answering, CancelOnDrop};
use crate::tools::{call_grammar, ToolChoice, ToolFormat, Tools};
use crate::worker::{SubmitError, Worker};

const CHAT_PAGE: &str = include_str!("../assets/chat.html");

/// What the server answers with and how.
pub struct Options {
    /// The name `/v1/models` lists and requests may give as `model`.
    pub model_name: String,
    pub tokenizer: Tokenizer,
    /// For `/v1/chat/completions`; without one, chat requests get 400. A template without a system
    /// turn gets system messages at the head of the next user message ([`crate::chat`]).
    pub template: Option<ChatTemplate>,
    /// The model's context (prompt and answer together).
    pub context: usize,
    /// The width of the model's logits (ids `logit_bias` may name; masks of structured output).
    pub vocab_size: usize,
    /// The sampling of requests that set none (`temperature`, `top_p` left out): the model's chat
    /// defaults ([`crate::sampling::ChatDefaults`]).
    pub sampling: ember_generate::sample::SamplingConfig,
    /// `Host` names answered besides localhost and the address a connection came in on.
    pub allowed_hosts: Vec<String>,
    /// Required as `Authorization: Bearer KEY` when set.
    pub api_key: Option<String>,
    pub limits: Limits,
}

/// A running server; dropping it stops accepting connections.
pub struct Server(ember_http::Server);

impl Server {
    /// Serves on `addr` (port 0: any free port) with the engine behind `worker`. Returns once listening.
    pub fn start(addr: SocketAddr, worker: Worker, mut options: Options) -> Result<Self, StartError> {
        let settings = Settings {
            name: "ember-serve",
            threads: 2,
            priority: Priority::Normal,
            allowed_hosts: options.allowed_hosts.clone(),
            limits: options.limits.clone(),
        };
        let chat = options.template.take().map(ChatPrompt::new);
        if chat.as_ref().is_some_and(|c| !c.renders_system()) {
            tracing::warn!(
                "the model's chat template renders no system message: a request's system messages are put at the \
                 head of the next user message (as llama.cpp's server does)"
            );
        }
        let end_ids = options.tokenizer.end_ids();
        let grammars = Grammars::new(&options.tokenizer, &end_ids, options.vocab_size).map_err(|e| {
            tracing::warn!("structured output (response_format, tool_choice) is off: {e}");
            e.to_string()
        });
        let state = State {
            worker,
            options,
            chat,
            grammars: grammars.map(Arc::new),
            next_id: AtomicU64::new(1),
            cut: watch::channel(false).0,
        };
        ember_http::Server::start(addr, settings, state).map(Self)
    }

    /// Stops gracefully (see [`ember_http::Server::drain`]): answers in work get `grace` to
    /// finish; the rest end with a last event (streams) or 503 (whole answers) naming the
    /// shutdown.
    pub fn drain(self, grace: Duration) -> Drained {
        self.0.drain(grace)
    }

    pub fn addr(&self) -> SocketAddr {
        self.0.addr()
    }

    /// Serves until the process ends.
    pub fn wait(self) {
        self.0.wait()
    }
}

struct State {
    worker: Worker,
    /// Its `template` taken into `chat`.
    options: Options,
    chat: Option<ChatPrompt>,
    /// Structured output's token masks, or why this tokenizer cannot have them.
    grammars: Result<Arc<Grammars>, String>,
    next_id: AtomicU64,
    /// Set when the answers in work are to end now (a drain's grace period is over).
    cut: watch::Sender<bool>,
}

impl State {
    /// Resolves when the answers in work are to end ([`Service::cut`]); owns what it waits on, so
    /// that a streamed answer's task can hold it.
    fn cut_signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.cut.subscribe();
        async move {
            let _ = rx.wait_for(|&cut| cut).await;
        }
    }
}

impl Service for State {
    type Body = AnswerBody;

    fn refuse(&self, why: Refused) -> Answer {
        match why {
            Refused::Host(host) => {
                let message = format!("Host `{host}` is not served");
                error(StatusCode::FORBIDDEN, "invalid_request_error", &message, None, None)
            }
            Refused::BodyTooLarge(limit) => {
                let message = format!("the body is larger than {limit} bytes");
                error(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", &message, None, None)
            }
            Refused::ShuttingDown => shutting_down(),
        }
    }

    async fn answer(self: Arc<Self>, request: Request<Incoming>, conn: Arc<Conn>) -> Answer {
        let (method, path) = (request.method().clone(), request.uri().path().to_string());
        let start = Instant::now();
        let answer = route(&self, request, &conn).await;
        let ms = start.elapsed().as_millis();
        let status = answer.status().as_u16();
        match answer.extensions().get::<Logged>() {
            Some(Logged::Usage(u)) => tracing::info!(
                "{method} {path} {status} in {ms} ms: {} prompt + {} completion tokens",
                u.prompt_tokens,
                u.completion_tokens
            ),
            Some(Logged::Stream(id)) => tracing::info!("{method} {path} {status} in {ms} ms: streaming {id}"),
            None => tracing::info!("{method} {path} {status} in {ms} ms"),
        }
        answer
    }

    fn cut(&self) {
        self.cut.send_replace(true);
    }
}

/// What the request log adds to an answer's line.
#[derive(Debug, Clone)]
enum Logged {
    Usage(Usage),
    /// A streamed answer's id; its stream logs its own end.
    Stream(String),
}

/// The answer to a request the server cannot finish because it is stopping.
fn shutting_down() -> Answer {
    error(StatusCode::SERVICE_UNAVAILABLE, "server_error", SHUTTING_DOWN, None, Some("server_shutdown"))
}

pub(crate) const SHUTTING_DOWN: &str = "the server is shutting down";

type Answer = Response<AnswerBody>;

/// A whole body, or the server-sent events of a streamed answer as they come (its connection
/// marked as working until the body ends).
pub enum AnswerBody {
    Full(Full<Bytes>),
    Events(mpsc::Receiver<Bytes>, Working),
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Self::Full(full) => Pin::new(full).poll_frame(cx),
            Self::Events(rx, _) => rx.poll_recv(cx).map(|chunk| chunk.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(full) => full.size_hint(),
            Self::Events(..) => SizeHint::default(),
        }
    }
}

fn json_answer(status: StatusCode, body: &Value) -> Answer {
    let mut r = Response::new(AnswerBody::Full(Full::new(Bytes::from(body.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn error(status: StatusCode, kind: &str, message: &str, param: Option<&str>, code: Option<&str>) -> Answer {
    json_answer(status, &error_body(kind, message, param, code))
}

fn invalid(e: Invalid) -> Answer {
    if e.param == "model" {
        // As OpenAI answers a model it does not have.
        return error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &e.message,
            Some("model"),
            Some("model_not_found"),
        );
    }
    error(StatusCode::BAD_REQUEST, "invalid_request_error", &e.message, Some(&e.param), None)
}

/// Why a POST is refused before its body is read: a cross-origin browser request (403) or a body
/// that is not declared JSON (415).
fn refuse_post(req: &Request<Incoming>) -> Option<Answer> {
    let headers = req.headers();
    if let Some(origin) = headers.get(ORIGIN) {
        // A browser names the page that sent the request; only this server's own page may.
        let host = headers.get(HOST).and_then(|h| h.to_str().ok()).unwrap_or_default();
        let origin = origin.to_str().unwrap_or("(not text)");
        if origin != format!("http://{host}") {
            let message = format!(
                "cross-origin requests are refused: Origin `{origin}` is not this server's page (http://{host})"
            );
            return Some(error(StatusCode::FORBIDDEN, "invalid_request_error", &message, None, Some("cross_origin")));
        }
    }
    let content_type = headers.get(CONTENT_TYPE).map(|h| h.to_str().unwrap_or("(not text)"));
    let media = content_type.map(|c| c.split(';').next().unwrap_or_default().trim().to_ascii_lowercase());
    if media.as_deref() != Some("application/json") {
        let message = format!(
            "the body must be JSON sent as `Content-Type: application/json`; got {}",
            content_type.map_or_else(|| "no Content-Type".to_string(), |c| format!("`{c}`"))
        );
        let code = Some("unsupported_media_type");
        return Some(error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "invalid_request_error", &message, None, code));
    }
    None
}

async fn route(state: &State, req: Request<Incoming>, conn: &Arc<Conn>) -> Answer {
    let path = req.uri().path().to_string();
    // The chat page holds no secret: it is served to anyone who reaches the server, and asks its
    // user for the key.
    let page = req.method() == Method::GET && path == "/";
    if let (Some(key), false) = (&state.options.api_key, page) {
        let given =
            req.headers().get(AUTHORIZATION).and_then(|h| h.to_str().ok()).and_then(|h| h.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            let message = "a valid API key is required (Authorization: Bearer KEY)";
            return error(StatusCode::UNAUTHORIZED, "invalid_request_error", message, None, Some("invalid_api_key"));
        }
    }
    if req.method() == Method::POST {
        if let Some(refused) = refuse_post(&req) {
            return refused;
        }
    }
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/") => {
            let mut r = Response::new(AnswerBody::Full(Full::new(Bytes::from_static(CHAT_PAGE.as_bytes()))));
            r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
            r
        }
        (Method::GET, "/v1/models") => {
            // The fields each endpoint honours (any other is refused by name).
            let model = json!({
                "id": state.options.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "ember",
                "max_model_len": state.options.context,
                "honoured_fields": {"/v1/chat/completions": chat_fields(), "/v1/completions": completion_fields()},
            });
            json_answer(StatusCode::OK, &json!({"object": "list", "data": [model]}))
        }
        (Method::GET, "/health") => {
            let u = state.worker.cache_use();
            let cache = json!({
                "block_size": u.block_size,
                "held_blocks": u.held_blocks,
                "peak_blocks": u.peak_blocks,
                "prompt_tokens": u.prompt_tokens,
                "reused_prompt_tokens": u.reused_tokens,
            });
            json_answer(StatusCode::OK, &json!({"status": "ok", "kv_cache": cache}))
        }
        (Method::POST, "/v1/completions") => match read_json::<CompletionRequest>(state, req).await {
            Ok(r) => completion(state, r, conn).await,
            Err(answer) => answer,
        },
        (Method::POST, "/v1/chat/completions") => match read_json::<ChatRequest>(state, req).await {
            Ok(r) => chat(state, r, conn).await,
            Err(answer) => answer,
        },
        (Method::POST, "/tokenize") => match read_json::<AnyJson>(state, req).await {
            Ok(AnyJson(body)) => tokenize(state, &body),
            Err(answer) => answer,
        },
        (Method::POST, "/detokenize") => match read_json::<AnyJson>(state, req).await {
            Ok(AnyJson(body)) => detokenize(state, &body),
            Err(answer) => answer,
        },
        (
            _,
            "/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/" | "/health" | "/tokenize" | "/detokenize",
        ) => error(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed", None, None),
        _ => error(StatusCode::NOT_FOUND, "invalid_request_error", &format!("no such endpoint: {path}"), None, None),
    }
}

/// The body as JSON read into a `T`, within the size and time limits (a body announced over the
/// size limit never gets here: the shell refuses it). Bad JSON is refused with the parser's
/// message; a field of the wrong type with a message naming it and what it should be, as `param`.
async fn read_json<T: TryFrom<Value, Error = Invalid>>(state: &State, req: Request<Incoming>) -> Result<T, Answer> {
    let limits = &state.options.limits;
    let body = Limited::new(req.into_body(), usize::try_from(limits.max_body).unwrap_or(usize::MAX));
    let bytes = match tokio::time::timeout(limits.body_timeout, body.collect()).await {
        Err(_) => {
            return Err(error(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                "the body did not arrive in time",
                None,
                None,
            ))
        }
        Ok(Err(_)) => return Err(state.refuse(Refused::BodyTooLarge(limits.max_body))),
        Ok(Ok(collected)) => collected.to_bytes(),
    };
    let body: Value = serde_json::from_slice(&bytes).map_err(|e| {
        let message = format!("could not parse the JSON body: {e}");
        error(StatusCode::BAD_REQUEST, "invalid_request_error", &message, None, None)
    })?;
    T::try_from(body).map_err(|e| {
        // An empty param is the body as a whole.
        let param = Some(e.param.as_str()).filter(|p| !p.is_empty());
        error(StatusCode::BAD_REQUEST, "invalid_request_error", &e.message, param, None)
    })
}

/// A body read as JSON and checked by its endpoint.
struct AnyJson(Value);

impl TryFrom<Value> for AnyJson {
    type Error = Invalid;

    fn try_from(v: Value) -> Result<Self, Invalid> {
        Ok(Self(v))
    }
}

/// `POST /tokenize {"prompt": TEXT}` → `{"tokens": [ids], "count": n}`: the ids a completion's
/// prompt becomes (vLLM's and llama.cpp's endpoint).
fn tokenize(state: &State, body: &Value) -> Answer {
    let Some(text) = body.get("prompt").and_then(Value::as_str) else {
        return invalid(Invalid::new("prompt", "prompt is required: the text to tokenize"));
    };
    match state.options.tokenizer.encode_prompt(text) {
        Ok(ids) => json_answer(StatusCode::OK, &json!({"tokens": ids, "count": ids.len()})),
        Err(e) => invalid(Invalid::new("prompt", e.to_string())),
    }
}

/// `POST /detokenize {"tokens": [ids]}` → `{"prompt": TEXT}`.
fn detokenize(state: &State, body: &Value) -> Answer {
    let vocab = state.options.tokenizer.vocab_size();
    let ids: Option<Vec<u32>> = body
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|t| t.as_u64().filter(|&t| (t as usize) < vocab).map(|t| t as u32)).collect());
    let Some(ids) = ids else {
        let message = format!("tokens is required: a list of token ids below {vocab}");
        return invalid(Invalid::new("tokens", message));
    };
    match state.options.tokenizer.decode(&ids) {
        Ok(text) => json_answer(StatusCode::OK, &json!({"prompt": text})),
        Err(e) => invalid(Invalid::new("tokens", e.to_string())),
    }
}

/// New tokens of a completion whose request names no `max_tokens`, as OpenAI's default.
pub const COMPLETION_MAX_TOKENS: usize = 16;

/// Prompts of one completion request at most (each with its `n` choices).
pub const MAX_PROMPTS: usize = 16;

impl State {
    fn served(&self) -> Served {
        Served {
            model: self.options.model_name.clone(),
            vocab_size: self.options.vocab_size,
            defaults: self.options.sampling.clone(),
        }
    }
}

async fn completion(state: &State, r: CompletionRequest, conn: &Arc<Conn>) -> Answer {
    let prepared = (|| {
        let mut generation = r.settings.generation(Kind::Completion, &state.served())?;
        generation.max_tokens.get_or_insert(COMPLETION_MAX_TOKENS);
        if r.prompt.is_empty() || r.prompt.len() > MAX_PROMPTS {
            return Err(Invalid::new(
                "prompt",
                format!("{} prompts; from 1 to {MAX_PROMPTS} per request", r.prompt.len()),
            ));
        }
        let prompts = match &r.prompt {
            Prompts::Texts(texts) => texts
                .iter()
                .map(|p| state.options.tokenizer.encode_prompt(p).map_err(|e| Invalid::new("prompt", e.to_string())))
                .collect::<Result<Vec<_>, _>>()?,
            Prompts::Ids(ids) => ids.clone(),
        };
        Ok::<_, Invalid>((prompts, generation))
    })();
    match prepared {
        Ok((prompts, generation)) => run(state, Kind::Completion, prompts, generation, None, conn).await,
        Err(e) => invalid(e),
    }
}

async fn chat(state: &State, r: ChatRequest, conn: &Arc<Conn>) -> Answer {
    let Some(template) = &state.chat else {
        return invalid(Invalid::new("messages", "this model has no chat template; use /v1/completions"));
    };
    let prepared = (|| {
        let mut generation = r.settings.generation(Kind::Chat, &state.served())?;
        let tools = Tools::read(r.tools.as_ref())?;
        let choice = ToolChoice::read(r.tool_choice.as_ref(), &tools)?;
        if let (Some(i), ToolChoice::Auto) = (tools.strict(), &choice) {
            return Err(Invalid::new(
                format!("tools[{i}].function.strict"),
                "strict function calling is honoured with tool_choice `required` or a named function (a grammar \
                 then writes each call under its function's schema); with `auto` the model may write anything",
            ));
        }
        let messages = r.messages(template.roles())?;
        // `tool_choice: "none"`: the model is not shown the tools, and its answer is text.
        let offered = if choice == ToolChoice::None { Tools::default() } else { tools };
        let text = template.render_with_tools(&messages, &offered)?;
        let ids = state.options.tokenizer.encode_prompt(&text).map_err(|e| Invalid::new("messages", e.to_string()))?;
        let format = template.tool_format();
        let special = |t: &str| state.options.tokenizer.token_to_id(t);
        let single = r.parallel_tool_calls == Some(false);
        if r.parallel_tool_calls.is_some() && offered.is_empty() {
            return Err(Invalid::new(
                "parallel_tool_calls",
                "parallel_tool_calls is only allowed when tools are offered (and tool_choice is not none)",
            ));
        }
        generation.single_call = single;
        if let Some(lark) = call_grammar(format, &offered, &choice, single, &special) {
            if generation.format != Format::Text {
                return Err(Invalid::new(
                    "response_format",
                    "response_format and a tool_choice of `required` or a named function both constrain the answer: \
                     give one",
                ));
            }
            generation.grammar = Some(lark);
        }
        let calls = (!offered.is_empty()).then_some(format);
        Ok::<_, Invalid>((ids, generation, calls))
    })();
    match prepared {
        Ok((ids, generation, calls)) => run(state, Kind::Chat, vec![ids], generation, calls, conn).await,
        Err(e) => invalid(e),
    }
}

/// Refuses a prompt that leaves no room in the context, as OpenAI does (`context_length_exceeded`).
fn check_context(kind: Kind, prompt: &[u32], max_tokens: Option<usize>, context: usize) -> Result<(), Answer> {
    let param = if kind == Kind::Chat { "messages" } else { "prompt" };
    let what = if kind == Kind::Chat { "messages" } else { "prompt" };
    let overflow = |param: &str, message: String| {
        Err(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &message,
            Some(param),
            Some("context_length_exceeded"),
        ))
    };
    if prompt.len() >= context {
        return overflow(
            param,
            format!(
                "This model's maximum context length is {context} tokens. However, your {what} resulted in {} tokens, \
                 leaving no room for an answer. Please reduce the length of the {what}.",
                prompt.len()
            ),
        );
    }
    match max_tokens {
        Some(m) if m > context - prompt.len() => overflow(
            "max_tokens",
            format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens ({} in \
                 the {what}, {m} in the completion). Please reduce the length of the {what} or the completion.",
                prompt.len().saturating_add(m),
                prompt.len()
            ),
        ),
        _ => Ok(()),
    }
}

/// The engine request of choice `j` of `prompt` (its seed `seed + j`: each choice reproducible
/// whatever else the engine runs beside it).
fn engine_request(
    state: &State,
    prompt: &[u32],
    g: &Generation,
    spec: Option<&Spec>,
    (seed, j): (u64, usize),
) -> Result<EngineRequest, Invalid> {
    let context = state.options.context;
    let max_new_tokens = g.max_tokens.unwrap_or(context.saturating_sub(prompt.len()).max(1));
    let sampler = Sampler::new(g.sampling.clone(), seed.wrapping_add(j as u64))
        .and_then(|s| s.adjusted(g.adjustments.clone()))
        .map_err(|e| Invalid::new(e.setting().unwrap_or("temperature"), e.to_string()))?;
    let ends = if g.ignore_eos { Vec::new() } else { state.options.tokenizer.end_ids() };
    let mut request = EngineRequest::new(prompt.to_vec(), max_new_tokens, ends, sampler);
    request.logprobs = g.logprobs;
    if let Some(spec) = spec {
        let grammars = state.grammars.as_ref().map_err(|why| Invalid::new("response_format", why.clone()))?;
        request.constraint =
            Some(grammars.constraint(spec).map_err(|e| Invalid::new("response_format", e.to_string()))?);
    }
    Ok(request)
}

/// The grammar `g` asks for (`response_format`, or the tool calls `tool_choice` requires),
/// checked: a schema llguidance refuses is the client's error.
fn format_spec(state: &State, g: &Generation) -> Result<Option<Spec>, Invalid> {
    if let Some(lark) = &g.grammar {
        let grammars = state.grammars.as_ref().map_err(|why| Invalid::new("tool_choice", why.clone()))?;
        let spec = Spec::Lark(lark.clone());
        grammars.check(&spec).map_err(|e| Invalid::new("tools", e.to_string()))?;
        return Ok(Some(spec));
    }
    let format = &g.format;
    let spec = match format {
        Format::Text => return Ok(None),
        Format::JsonObject => Spec::JsonObject,
        Format::JsonSchema { schema, strict, .. } => Spec::JsonSchema { schema: schema.clone(), strict: *strict },
    };
    let grammars = state.grammars.as_ref().map_err(|why| Invalid::new("response_format", why.clone()))?;
    let param = if matches!(format, Format::JsonSchema { .. }) {
        "response_format.json_schema.schema"
    } else {
        "response_format"
    };
    grammars.check(&spec).map_err(|e| Invalid::new(param, e.to_string()))?;
    Ok(Some(spec))
}

/// Runs a checked request on the engine (each prompt's `n` choices) and answers it, whole or
/// streamed.
/// `calls`: the format in which the answer may call tools (chat with tools).
async fn run(
    state: &State,
    kind: Kind,
    prompts: Vec<Vec<u32>>,
    g: Generation,
    calls: Option<ToolFormat>,
    conn: &Arc<Conn>,
) -> Answer {
    let choices = prompts.len() * g.n;
    if choices > state.worker.capacity() {
        let message = format!(
            "{} prompt(s) × n = {} make {choices} choices; this server takes {} requests at once (--slots and --queue)",
            prompts.len(),
            g.n,
            state.worker.capacity()
        );
        return invalid(Invalid::new("n", message));
    }
    for p in &prompts {
        if let Err(answer) = check_context(kind, p, g.max_tokens, state.options.context) {
            return answer;
        }
    }
    if g.ignore_eos && (g.format != Format::Text || g.grammar.is_some()) {
        let message = "ignore_eos cannot be combined with response_format or a required tool_choice: the grammar \
                       decides where the answer ends";
        return invalid(Invalid::new("ignore_eos", message));
    }
    let spec = match format_spec(state, &g) {
        Ok(spec) => spec,
        Err(e) => return invalid(e),
    };
    let seed =
        g.seed.unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    let mut subs = Vec::with_capacity(prompts.len() * g.n);
    let cancel_all = |subs: &[Submitted]| subs.iter().for_each(|s| state.worker.cancel(s.id));
    for (i, prompt) in prompts.iter().enumerate() {
        for j in 0..g.n {
            let request = match engine_request(state, prompt, &g, spec.as_ref(), (seed, j)) {
                Ok(r) => r,
                Err(e) => {
                    cancel_all(&subs);
                    return invalid(e);
                }
            };
            match state.worker.submit(request).await {
                Ok((id, events)) => {
                    subs.push(Submitted { index: i * g.n + j, prompt_index: i, id, prompt: prompt.clone(), events })
                }
                Err(e) => {
                    cancel_all(&subs);
                    return refused(e);
                }
            }
        }
    }
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    let head = ChunkHead {
        id: format!("{}-{n}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        model: state.options.model_name.clone(),
        with_usage: g.include_usage,
    };
    let shape = Shape {
        kind,
        stops: g.stop.clone(),
        ends: if g.ignore_eos { Vec::new() } else { state.options.tokenizer.end_ids() },
        logprobs: g.logprobs.is_some(),
        echo: g.echo,
        tools: calls,
        single_call: g.single_call,
        vocab: state.grammars.as_ref().ok().cloned(),
    };
    let ids: Vec<u64> = subs.iter().map(|s| s.id).collect();
    if !g.stream {
        let worker = state.worker.clone();
        // Dropped with this future when the client disconnects (hyper drops the request's future).
        let _cancel = CancelOnDrop { worker: &worker, ids };
        let collected =
            race(collect(&state.options.tokenizer, &shape, subs, |id| worker.cancel(id)), state.cut_signal()).await;
        return match collected {
            Either::Left(Ok((choices, usage))) => {
                let mut r =
                    json_answer(StatusCode::OK, &kind.response(&head.id, head.created, &head.model, &choices, usage));
                r.extensions_mut().insert(Logged::Usage(usage));
                r
            }
            // A grammar and a `logit_bias` that together allow no token: the request's own doing.
            Either::Left(Err(Failed { message, client: true })) => {
                error(StatusCode::BAD_REQUEST, "invalid_request_error", &message, Some("logit_bias"), None)
            }
            Either::Left(Err(Failed { message, client: false })) => {
                error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", &message, None, None)
            }
            Either::Right(()) => shutting_down(),
        };
    }
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let (id, cut) = (head.id.clone(), state.cut_signal());
    let answering = Answering {
        head,
        shape,
        tokenizer: state.options.tokenizer.clone(),
        worker: state.worker.clone(),
        user: g.user.clone(),
    };
    tokio::spawn(answering.stream(subs, tx, cut));
    let mut r = Response::new(AnswerBody::Events(rx, conn.working()));
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut().insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r.extensions_mut().insert(Logged::Stream(id));
    r
}

fn refused(e: SubmitError) -> Answer {
    match e {
        SubmitError::Engine(EngineError::QueueFull(n)) => {
            let message = format!("the server is busy: {n} requests are waiting; retry later");
            let mut r = error(StatusCode::TOO_MANY_REQUESTS, "server_busy", &message, None, Some("queue_full"));
            r.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("1"));
            r
        }
        SubmitError::Engine(e @ EngineError::TooLong { .. }) => error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &e.to_string(),
            Some("max_tokens"),
            Some("context_length_exceeded"),
        ),
        SubmitError::Engine(e @ EngineError::Prompt(_)) => {
            error(StatusCode::BAD_REQUEST, "invalid_request_error", &e.to_string(), Some("prompt"), None)
        }
        SubmitError::Engine(e @ EngineError::TopLogprobs(_)) => {
            error(StatusCode::BAD_REQUEST, "invalid_request_error", &e.to_string(), Some("top_logprobs"), None)
        }
        SubmitError::Stopped => {
            error(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine has stopped", None, None)
        }
    }
}
