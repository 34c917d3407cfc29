//! orders-service: `DATABASE_URL=postgres://... orders-service` serves `POST /orders` on
//! `LISTEN` (default `127.0.0.1:3000`) and runs the `order-totals` subscription until
//! Ctrl-C.

use orders_service::BoxError;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL")?;
    let pool = sqlx::PgPool::connect(&url).await?;
    orders_service::migrate(&pool).await?;

    let config: pgbus::ConnectConfig = url.parse()?;
    let running = orders_service::bus(config, pool.clone())?.start().await?;

    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".to_string());
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    axum::serve(listener, orders_service::router(pool))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    running.shutdown().await?;
    Ok(())
}
