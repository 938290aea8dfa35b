//! `knowledge`: a knowledge base of N chunks (synthetic documents of ten paragraphs, words
//! drawn from a 30,000-word vocabulary by Zipf's law, a tenth of the documents in Chinese)
//! added through the background ingest API in batches of 500 documents, then questions of
//! three to six words (drawn the same way, so some words are common and some rare, as in
//! real questions) asked through `GET /api/admin/knowledge/<name>/search` (k = 5): ingest
//! rate in chunks per second, search p50 and p99. Words only (no embedding provider).

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use assistd::config::Role;

use crate::harness::*;
use crate::*;

const VOCABULARY: usize = 30_000;
const DOCUMENT_BATCH: usize = 500;
const PARAGRAPHS: usize = 10;
const QUESTIONS: usize = 300;

/// Deterministic words and a Zipf sampler over them.
struct Words {
    words: Vec<String>,
    /// Cumulative weights (1/rank), for sampling.
    cumulative: Vec<f64>,
    rng: fastrand::Rng,
}

impl Words {
    fn new(seed: u64) -> Words {
        let mut rng = fastrand::Rng::with_seed(seed);
        let syllables = [
            "ka", "lo", "min", "ter", "va", "sul", "qui", "dor", "pe", "ran", "tos", "el", "mu",
            "bri", "cha", "no", "fel", "ix", "gar", "hu",
        ];
        let han = "报销制度员工出差费用申请财务系统提交发票审批经理总监假期年度电脑网络设备安全培训合同客户项目会议预算采购";
        let han: Vec<char> = han.chars().collect();
        let mut words = Vec::with_capacity(VOCABULARY);
        let mut seen = std::collections::HashSet::new();
        while words.len() < VOCABULARY {
            let word = if words.len() % 10 == 9 {
                (0..2 + rng.usize(0..2))
                    .map(|_| han[rng.usize(0..han.len())])
                    .collect()
            } else {
                (0..2 + rng.usize(0..3))
                    .map(|_| syllables[rng.usize(0..syllables.len())])
                    .collect::<String>()
            };
            if seen.insert(word.clone()) {
                words.push(word);
            }
        }
        let mut total = 0.0;
        let cumulative = (1..=VOCABULARY)
            .map(|rank| {
                total += 1.0 / rank as f64;
                total
            })
            .collect();
        Words {
            words,
            cumulative,
            rng,
        }
    }

    fn word(&mut self) -> &str {
        let total = *self.cumulative.last().unwrap_or(&1.0);
        let at = self.rng.f64() * total;
        let i = self.cumulative.partition_point(|c| *c < at);
        &self.words[i.min(VOCABULARY - 1)]
    }

    /// A paragraph of about `chars` characters.
    fn paragraph(&mut self, chars: usize) -> String {
        let mut text = String::new();
        while text.chars().count() < chars {
            let w = self.word().to_string();
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(&w);
        }
        text.push('.');
        text
    }
}

async fn call(
    http: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    body: Option<Value>,
) -> anyhow::Result<Value> {
    let mut request = http.request(method, url).bearer_auth("bench-admin");
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await?;
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    anyhow::ensure!(status.is_success(), "{url}: {status} {body}");
    Ok(body)
}

pub(crate) async fn knowledge(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    let mut config = bench_config(&db.url, &mocks, Role::All, 16)?;
    config.knowledge.ingest_poll_ms = 50;
    let server = start_server(config).await?;
    let base = format!("http://{}/api/admin/knowledge", server.addr);
    let http = reqwest::Client::new();
    call(
        &http,
        reqwest::Method::POST,
        &base,
        Some(json!({"name": "bench"})),
    )
    .await?;
    let mut words = Words::new(34);
    let documents = args.n.div_ceil(PARAGRAPHS).max(1);
    let started = Instant::now();
    let mut jobs = Vec::new();
    let mut made = 0;
    while made < documents {
        let batch: Vec<Value> = (made..documents.min(made + DOCUMENT_BATCH))
            .map(|d| {
                let text: Vec<String> = (0..PARAGRAPHS).map(|_| words.paragraph(1000)).collect();
                json!({"id": format!("doc-{d}"), "text": text.join("\n\n")})
            })
            .collect();
        made += batch.len();
        let job = call(
            &http,
            reqwest::Method::POST,
            &format!("{base}/bench/ingest"),
            Some(json!({"documents": batch})),
        )
        .await?;
        jobs.push(job["id"].as_i64().unwrap_or_default());
    }
    let chunks = loop {
        let shown = call(&http, reqwest::Method::GET, &format!("{base}/bench"), None).await?;
        if shown["ingest"]["state"] == "idle" && shown["ingest"]["last"]["id"] == json!(jobs.last())
        {
            anyhow::ensure!(
                shown["document_count"] == json!(documents),
                "{} of {documents} documents in",
                shown["document_count"]
            );
            break shown["chunks"].as_i64().unwrap_or(0);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let ingest = started.elapsed();
    let mut times = Vec::with_capacity(QUESTIONS);
    // Questions with a word that tells passages apart, and those of common words only.
    let (mut telling, mut common) = (Vec::new(), Vec::new());
    let mut found = 0;
    for _ in 0..QUESTIONS {
        let n = 3 + words.rng.usize(0..4);
        let q: Vec<String> = (0..n).map(|_| words.word().to_string()).collect();
        let q: String = url::form_urlencoded::byte_serialize(q.join(" ").as_bytes()).collect();
        let url = format!("{base}/bench/search?q={q}&k=5");
        let asked = Instant::now();
        let body = call(&http, reqwest::Method::GET, &url, None).await?;
        times.push(asked.elapsed());
        if body["words"]["all_required"] == true {
            common.push(asked.elapsed());
        } else {
            telling.push(asked.elapsed());
        }
        found += usize::from(body["results"].as_array().is_some_and(|r| !r.is_empty()));
    }
    times.sort();
    telling.sort();
    common.sort();
    println!(
        "scenario=knowledge db={} chunks={chunks} documents={documents} ingest_s={:.1} \
         ingest_chunks_per_s={:.0} questions={QUESTIONS} answered={found} search_p50={:.1}ms \
         search_p99={:.1}ms search_max={:.1}ms ranking=lexical telling_questions={} \
         telling_p50={:.1}ms telling_p99={:.1}ms common_only_questions={} common_only_p50={:.1}ms \
         common_only_p99={:.1}ms",
        db_name(args.db),
        ingest.as_secs_f64(),
        chunks as f64 / ingest.as_secs_f64().max(1e-9),
        percentile(&times, 0.50),
        percentile(&times, 0.99),
        times.last().map_or(0.0, |d| d.as_secs_f64() * 1000.0),
        telling.len(),
        percentile(&telling, 0.50),
        percentile(&telling, 0.99),
        common.len(),
        percentile(&common, 0.50),
        percentile(&common, 0.99),
    );
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
}
