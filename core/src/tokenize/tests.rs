use minijinja::value::Value as JValue;
use serde_json::Value;

use std::path::Path;

use super::template::{chat_environment, iterates_content, TEMPLATE};
use super::*;
use crate::request::{ApiKind, ParseOptions};
use crate::request::{InferenceRequest, Segment, TemplateInput};

fn render(template: &str, ctx: Value) -> String {
    let env = chat_environment(template.to_string()).unwrap();
    env.get_template(TEMPLATE)
        .unwrap()
        .render(JValue::from(minijinja::value::Serde(&ctx)))
        .unwrap()
}

#[test]
fn tojson_is_python_style_and_keeps_key_order() {
    let ctx = serde_json::json!({"x": {"b": 1, "a": [true, null, "<é>"], "f": 2.0}});
    assert_eq!(
        render("{{ x | tojson }}", ctx.clone()),
        r#"{"b": 1, "a": [true, null, "<é>"], "f": 2.0}"#
    );
    assert_eq!(
        render("{{ x.a | tojson(indent=2) }}", ctx),
        "[\n  true,\n  null,\n  \"<é>\"\n]"
    );
}

#[test]
fn python_methods_and_raise_exception() {
    let ctx = serde_json::json!({"s": "  Hi  "});
    assert_eq!(render("{{ s.strip().upper() }}", ctx.clone()), "HI");
    let env = chat_environment("{{ raise_exception('nope') }}".into()).unwrap();
    let err = env
        .get_template(TEMPLATE)
        .unwrap()
        .render(JValue::from(minijinja::value::Serde(&ctx)))
        .unwrap_err();
    assert!(err.to_string().contains("nope"));
}

fn parsed(kind: ApiKind, body: &str) -> InferenceRequest {
    let options = ParseOptions {
        limits: crate::request::PromptLimits::NONE,
        template: true,
    };
    crate::request::parse_with(body.as_bytes(), Some(kind), options).unwrap()
}

fn fixture(template: &str) -> Tokenizer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer");
    let mut tok = Tokenizer::load(dir).unwrap();
    tok.env = Some(chat_environment(template.to_string()).unwrap());
    tok.parts_content = false;
    tok
}

/// The parsed request renders exactly as the whole body read as a `Value`
/// did: every message field in order (`name`, `tool_call_id`, repeated
/// keys), `tools` and `chat_template_kwargs` as given, numbers as written.
#[test]
fn a_parsed_chat_renders_like_the_body_read_as_a_value() {
    let tok = fixture(
        "{{ messages | tojson }}|{{ tools | tojson }}|{{ enable_thinking }}|{{ bos_token }}|\
         {% for m in messages %}{{ m.role }}:{{ m.name }}:{{ m.tool_call_id }};{% endfor %}\
         {{ add_generation_prompt }}",
    );
    let body = r#"{"model":"m","messages":[
        {"role":"system","content":"be brief","name":"sys"},
        {"name":"ann","role":"user","content":[{"type":"text","text":"hi"},"there"]},
        {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"x\": 1.0}"}}]},
        {"tool_call_id":"c1","role":"tool","content":"42","extra":{"b":1,"a":[1.5,null,2.0]}},
        {"role":"user","name":"x","content":"again","name":"y"}],
        "tools":[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":2.50}}}],
        "chat_template_kwargs":{"enable_thinking":false,"bos_token":"ignored"},
        "nvext":{"backend_instance_id":3}}"#;
    let TemplateInput::Chat(chat) = parsed(ApiKind::Chat, body).template.unwrap() else {
        panic!("a chat")
    };
    // The context as the tokenizer used to build it from the body's `Value`.
    let value: Value = serde_json::from_str(body).unwrap();
    let mut messages = value["messages"].clone();
    messages[1]["content"] = Value::String("hi\nthere".into());
    let mut ctx = value["chat_template_kwargs"].as_object().unwrap().clone();
    ctx.extend(tok.special.clone());
    ctx.insert("messages".into(), messages);
    ctx.insert("tools".into(), value["tools"].clone());
    ctx.insert("add_generation_prompt".into(), Value::Bool(true));
    let expected = tok
        .env
        .as_ref()
        .unwrap()
        .get_template(TEMPLATE)
        .unwrap()
        .render(JValue::from(minijinja::value::Serde(&ctx)))
        .unwrap();
    let (text, images) = tok.render_chat(&chat).unwrap();
    assert!(images.is_empty());
    assert_eq!(text, expected);
    assert!(text.contains(r#""name": "y""#), "{text}");
    assert!(text.contains("tool::c1;"), "{text}");
    assert!(text.contains(r#""a": 2.5"#), "{text}");
    assert!(text.contains("|False|<s>|"), "{text}");
}

/// Each string of a completions prompt is encoded on its own, with its BOS.
#[test]
fn completion_prompt_items_keep_their_boundaries() {
    let tok = fixture("");
    let req = parsed(
        ApiKind::Completions,
        r#"{"model":"m","prompt":["good morning",[7,8],"the cat"]}"#,
    );
    let mut expected = tok.encode("good morning", true).unwrap();
    expected.extend([7, 8]);
    expected.extend(tok.encode("the cat", true).unwrap());
    assert_eq!(
        tok.tokenize_request(&req).unwrap(),
        vec![Segment::Tokens(expected.clone())]
    );
    let bos = expected[0];
    assert_eq!(expected.iter().filter(|&&t| t == bos).count(), 2);
    // Parsed without the template input, there is nothing to render.
    let plain = crate::request::parse(br#"{"model":"m","prompt":"x"}"#, None).unwrap();
    assert!(matches!(
        tok.tokenize_request(&plain),
        Err(TokenizeError::NoTemplateInput)
    ));
}

#[test]
fn content_format_detection() {
    assert!(iterates_content(
        "{% for part in message['content'] %}{{ part.text }}{% endfor %}"
    ));
    assert!(!iterates_content("{{ message['content'] }}"));
}
